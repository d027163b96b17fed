"""Saucer read throughput: any file at any revision, in process and over HTTP, against git itself.

A generated repository (--commits commits editing --files files, so most blobs are deltas) is ingested into a
fresh file store; then the same random (commit, path) reads are timed through:
  saucer (in-process reader), saucer over HTTP (``kiln saucer serve``, 16 concurrent keep-alive
  connections; latency from one sequential client), ``git cat-file --batch``
  (one long-lived git process: the strongest baseline) and ``git show REV:PATH`` (a process per read).
The server runs on the same 2 cores as its client, so the client must cost less than the server:
``saucer_http_reads_per_s`` uses a minimal HTTP/1.1 client over asyncio streams (one request at a time per
connection, status and Content-Length checked, body read in full); ``_httpx`` is the same reads through httpx,
whose own per-request cost (~1 ms) caps that figure near 1,000-1,200/s whatever the server does.
Usage: python bench/saucer.py [--commits 200] [--files 100] [--reads 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import httpx

from bench.common import report
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.processes import free_port
from tests.ingest.gitrepos import Builder, all_commits, files_at, write


def build(root: Path, commits: int, files: int, rng: random.Random) -> Builder:
    b = Builder(root)
    contents = {i: [f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(60)] for i in range(files)}
    for c in range(commits):
        for i in rng.sample(range(files), k=max(1, files // 10)) if c else range(files):
            lines = contents[i]
            lines[rng.randrange(len(lines))] = f"# edit {c}\n"
            write(root, f"pkg{i % 7}/mod{i}.py", "".join(lines))
        b.commit(f"commit {c}")
    return b


async def _light_reads(port: int, reads: list[tuple[str, bytes]], connections: int) -> float:
    queue = list(reads)

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                c, p = queue.pop()
                target = "/repos/bench/-/files/" + quote(p.decode()) + "?rev=" + c
                writer.write(f"GET {target} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
                status = await reader.readline()
                assert status.startswith(b"HTTP/1.1 200"), status
                length = None
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                assert length is not None, "no Content-Length"
                await reader.readexactly(length)
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(connections)))
    return time.perf_counter() - started


async def _httpx_reads(port: int, reads: list[tuple[str, bytes]], connections: int) -> float:
    queue = list(reads)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            while queue:
                c, p = queue.pop()
                (await http.get("/repos/bench/-/files/" + p.decode(), params={"rev": c})).raise_for_status()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(connections)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", type=int, default=200)
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--reads", type=int, default=3000)
    args = parser.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = build(root / "src", args.commits, args.files, rng).path
        store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
        started = time.perf_counter()
        event = asyncio.run(ingest(IngestRequest(name="bench", location=str(src)), "bench", store, root / "work"))
        ingest_s = time.perf_counter() - started
        commits = all_commits(src)
        sample = [(c, p) for c in rng.sample(commits, k=min(40, len(commits))) for p in files_at(src, c)]
        reads = [rng.choice(sample) for _ in range(args.reads)]
        repo = store.repository("bench")

        started = time.perf_counter()
        saucer_bytes = sum(len(repo.read(c, p)) for c, p in reads)
        saucer_s = time.perf_counter() - started

        batch = subprocess.Popen(["git", "-C", str(src), "cat-file", "--batch"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
        assert batch.stdin is not None and batch.stdout is not None
        started = time.perf_counter()
        git_bytes = 0
        for c, p in reads:
            batch.stdin.write(c.encode() + b":" + p + b"\n")
            batch.stdin.flush()
            size = int(batch.stdout.readline().split()[2])
            git_bytes += len(batch.stdout.read(size + 1)) - 1
        batch_s = time.perf_counter() - started
        batch.stdin.close()
        batch.wait()
        assert git_bytes == saucer_bytes

        spawn_reads = reads[: max(50, args.reads // 20)]
        started = time.perf_counter()
        for c, p in spawn_reads:
            subprocess.run(["git", "-C", str(src), "show", c.encode() + b":" + p], check=True, capture_output=True)
        show_s = (time.perf_counter() - started) / len(spawn_reads) * len(reads)

        port = free_port()
        # The server is its own process, as deployed (in this process it would share the client's GIL).
        server = subprocess.Popen([sys.executable, "-m", "kiln.streams.cli", "saucer", "serve", "--port", str(port)],
                                  env={**os.environ, "KILN_BLOB_STORE": f"file://{root / 'blobs'}",
                                       "KILN_CACHE": str(root / "server-cache")})
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        http.get("/healthz").raise_for_status()
                        break
                    except httpx.TransportError:
                        assert time.monotonic() < deadline, "saucer serve did not start"
                        time.sleep(0.1)
                started = time.perf_counter()
                for c, p in reads[:500]:
                    http.get("/repos/bench/-/files/" + p.decode(), params={"rev": c}).raise_for_status()
                http_latency_ms = (time.perf_counter() - started) / 500 * 1000
            httpx_s = asyncio.run(_httpx_reads(port, reads, 16))
            http_s = asyncio.run(_light_reads(port, reads, 16))
        finally:
            server.terminate()
            server.wait(10)

    n = len(reads)
    report("Saucer reads", {
        "saucer_ingest_s": round(ingest_s, 3),
        "saucer_pack_bytes": event.pack_bytes,
        "saucer_reads_per_s": round(n / saucer_s, 1),
        "saucer_http_reads_per_s": round(n / http_s, 1),
        "saucer_http_reads_per_s_httpx": round(n / httpx_s, 1),
        "saucer_http_vs_in_process": round(saucer_s / http_s, 4),
        "saucer_http_latency_ms": round(http_latency_ms, 3),
        "git_cat_file_batch_reads_per_s": round(n / batch_s, 1),
        "git_show_reads_per_s": round(n / show_s, 1),
        "saucer_vs_cat_file_batch": round(batch_s / saucer_s, 2),
        "saucer_vs_git_show": round(show_s / saucer_s, 2),
    }, {"repository": f"{args.commits} commits x {args.files} files, {event.objects} objects", "reads": str(n)})


if __name__ == "__main__":
    main()
