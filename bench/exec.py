"""Exec stage latency and throughput on real Docker through the broker, next to bare Docker.

- ``exec_warm_overhead_ms``: p50 of ``true`` in a warm session through kiln (client -> broker -> worker ->
  docker exec -> result) minus p50 of a bare ``docker exec`` of ``true`` (SDK) on a container of the same image.
- ``exec_cold_ratio``: p50 session open with an empty warm pool ÷ p50 of bare Docker doing the same job by hand:
  two tmpfs volumes, ``docker run -d`` with the same isolation flags, the image's ``/work`` copied in (its tar read
  once beforehand, as kiln caches it) — start to ready-for-commands, removal untimed on both sides. (The former
  baseline, ``docker run --rm IMAGE true``, is printed for information as ``docker_run_rm_ms``.)
- ``exec_cmds_per_s``: --sessions sessions each running ``true`` back to back for --seconds.
- ``exec_read_1000_files_ms``: p50 of one ``read_files`` of 1,000 small files through kiln (one archive call).
- ``exec_leaked_containers``: session containers of this bench's workers left after closing every session and
  stopping the worker (other containers on the same engine are not counted).
Usage: python -m bench.exec [--samples 40] [--sessions 8] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import broker, report
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams import admin
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.client import KilnClient
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits, docker_client
from kiln.workers.exec.client import ExecClient
from tests.workers.builder.projects import python_project


def p50(values: list[float]) -> float:
    return statistics.median(values)


async def build_image(root: Path, client: Any) -> str:
    store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
    python_project(root / "src")
    await ingest(IngestRequest(name="bench/exec", location=str(root / "src")), "r", store, root / "w")
    event = await build_revision(BuildRequest(repository="bench/exec"), store, client,
                                 BaseImages("kiln/base:latest", "kiln/toolchain:latest"), root / "w",
                                 Limits(timeout_s=600))
    assert event.image, event.detail
    return event.image


def bare_open(client: Any, image: str, work_tar: bytes) -> tuple[float, Any, list[Any]]:
    """What a cold session open does, by hand with the SDK; returns its seconds and what to remove afterwards."""
    started = time.perf_counter()
    volumes = [client.volumes.create(f"bench-{uuid.uuid4().hex[:12]}", driver="local",
                                     driver_opts={"type": "tmpfs", "device": "tmpfs",
                                                  "o": "size=256m,uid=1000,gid=1000,mode=0755"}) for _ in range(2)]
    container = client.containers.run(
        image, ["sleep", "infinity"], detach=True, network_mode="none", user="0:0", read_only=True,
        volumes={volumes[0].name: {"bind": "/work", "mode": "rw"}, volumes[1].name: {"bind": "/tmp", "mode": "rw"}},
        working_dir="/work", mem_limit=1 << 30, nano_cpus=10**9, pids_limit=256, security_opt=["no-new-privileges"],
        cap_drop=["ALL"], init=True)
    container.put_archive("/work", work_tar)
    return time.perf_counter() - started, container, volumes


def bare_docker(client: Any, image: str, samples: int) -> tuple[float, float, float]:
    """p50 of: a bare open (see ``bare_open``), ``docker run --rm IMAGE true``, ``docker exec true``."""
    source = client.containers.create(image, ["true"], network_mode="none")
    try:
        work_tar = b"".join(source.get_archive("/work/.")[0])
    finally:
        source.remove(force=True)
    opens, runs = [], []
    for _ in range(max(5, samples // 4)):
        seconds, container, volumes = bare_open(client, image, work_tar)
        opens.append(seconds)
        container.remove(force=True)
        for volume in volumes:
            volume.remove(force=True)
        t = time.perf_counter()
        client.containers.run(image, ["true"], remove=True, network_mode="none")
        runs.append(time.perf_counter() - t)
    container = client.containers.run(image, ["sleep", "infinity"], detach=True, network_mode="none")
    try:
        execs = []
        for _ in range(samples):
            t = time.perf_counter()
            container.exec_run(["true"], user="1000:1000")
            execs.append(time.perf_counter() - t)
    finally:
        container.remove(force=True)
    return p50(opens), p50(runs), p50(execs)


async def through_kiln(settings: KilnSettings, image: str, args: argparse.Namespace, warm: int,
                       lock_dir: Path, worker_ids: set[str]) -> dict[str, float]:
    worker = WorkerProcess("exec", settings, "exec.requests", slots=8, env={
        "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_EXEC_WARM": str(warm), "KILN_EXEC_LOCK_DIR": str(lock_dir),
        "KILN_METRICS_PORT": str(free_port())})
    out: dict[str, float] = {}
    try:
        worker.wait_assigned()
        # Its id (its liveness lock's name): the leak count is of this bench's workers' containers only — others
        # may be running on the same engine.
        worker_ids.update(await asyncio.to_thread(lambda: [p.stem for p in lock_dir.glob("*.lock")]))
        async with KilnClient(settings, f"bench-{uuid.uuid4().hex[:6]}") as kiln:
            client = ExecClient(kiln)
            opens, sessions = [], []
            for _ in range(max(5, args.samples // 4)):
                t = time.perf_counter()
                sessions.append(await client.open_session(image, repository="bench/exec"))
                opens.append(time.perf_counter() - t)
                if warm:
                    await asyncio.sleep(1.5)  # let the pool refill, as between real opens
            out["open_s"] = p50(opens)
            session = sessions[0]
            for _ in range(5):
                await client.run(session, "true")
            lat = []
            for _ in range(args.samples):
                t = time.perf_counter()
                await client.run(session, "true")
                lat.append(time.perf_counter() - t)
            out["cmd_s"] = p50(lat)
            paths = [f"bench/f{i}.txt" for i in range(1000)]
            await client.write_files(session, {p: f"content of {p}\n" for p in paths})
            reads = []
            for _ in range(3):
                t = time.perf_counter()
                assert len(await client.read_files(session, paths)) == len(paths)
                reads.append(time.perf_counter() - t)
            out["read_1000_s"] = p50(reads)
            done = 0
            deadline = time.monotonic() + args.seconds

            async def loop(s: Any) -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    await client.run(s, "true")
                    done += 1

            pool = sessions[: args.sessions]
            while len(pool) < args.sessions:
                pool.append(await client.open_session(image, repository="bench/exec"))
            started = time.monotonic()
            await asyncio.gather(*(loop(s) for s in pool))
            out["cmds_per_s"] = done / (time.monotonic() - started)
            for s in {s.session_id: s for s in sessions + pool}.values():
                await client.close_session(s)
    finally:
        worker.stop()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    run_steps(COMPONENT_STEPS["docker"])
    client = docker_client()
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    topics = [TopicSpec("exec.requests", 8), TopicSpec("exec.requests.dlq", 1),
              TopicSpec("kiln.results", 4)]
    admin.create_topics(settings, topics)
    worker_ids: set[str] = set()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            image = await build_image(Path(tmp), client)
            bare_open_s, docker_run_s, docker_exec_s = await asyncio.to_thread(bare_docker, client, image,
                                                                               args.samples)
            warm = await through_kiln(settings, image, args, 2, Path(tmp) / "locks", worker_ids)
            cold = await through_kiln(settings, image, args, 0, Path(tmp) / "locks", worker_ids)
    finally:
        admin.delete_topics(settings, [settings.topic(t.name) for t in topics])
    leaked = sum(c.labels.get("kiln.worker") in worker_ids
                 for c in client.containers.list(all=True, filters={"label": "kiln.role=exec-session"}))
    report("exec: sessions through kiln vs bare Docker", {
        "exec_warm_overhead_ms": round((warm["cmd_s"] - docker_exec_s) * 1000, 1),
        "exec_warm_cmd_ms": round(warm["cmd_s"] * 1000, 1),
        "docker_exec_ms": round(docker_exec_s * 1000, 1),
        "exec_cold_ratio": round(cold["open_s"] / bare_open_s, 2),
        "exec_cold_open_ms": round(cold["open_s"] * 1000, 1),
        "bare_docker_open_ms": round(bare_open_s * 1000, 1),
        "exec_warm_open_ms": round(warm["open_s"] * 1000, 1),
        "docker_run_rm_ms": round(docker_run_s * 1000, 1),
        "exec_cmds_per_s": round(warm["cmds_per_s"], 1),
        "exec_read_1000_files_ms": round(warm["read_1000_s"] * 1000, 1),
        "exec_leaked_containers": leaked,
    })


if __name__ == "__main__":
    asyncio.run(main())
