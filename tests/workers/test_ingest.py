"""The ``ingest`` stage on the real broker: events, one failure event per broken repository, DLQ for malformed
requests, metrics, and a replay that rebuilds an identical store from the recorded commits."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import HistoryRewrite, IngestEvent, IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.ingest.client import SaucerClient
from tests.ingest.gitrepos import Builder, rich_repository, write
from tests.stages import worker_env
from tests.streams.harness import read_all


async def test_ingest_events_failures_and_replay_rebuild(stage_topics: Callable[..., KilnSettings],
                                                         tmp_path: Path) -> None:
    settings = stage_topics(("repo.ingest", 2), ("repo.events", 1))
    one = rich_repository(tmp_path / "one")
    two = Builder(tmp_path / "two")
    write(two.path, "main.go", "package main\n")
    two.commit("go")
    port = free_port()
    env = worker_env(settings, KILN_METRICS_PORT=str(port))
    with WorkerProcess("ingest", settings, "repo.ingest", slots=2, env=env) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, "trainer") as kiln:
            client = SaucerClient(kiln)
            results = await asyncio.gather(
                client.ingest_repository(IngestRequest(name="acme/one", location=str(one.path))),
                client.ingest_repository(IngestRequest(name="acme/broken", location=str(tmp_path / "missing"))),
                client.ingest_repository(IngestRequest(name="acme/two", location=f"file://{two.path}")),
                client.ingest_repository(IngestRequest(name="acme/one-slim", rewrite=HistoryRewrite(
                    source="acme/one", operation="remove_path", path="large"))),
            )
            with pytest.raises(RequestFailed, match="MalformedRequest: invalid ingest payload: name"):
                await kiln.call("ingest", {"name": "../escape", "location": "/x"})
            after = await client.ingest_repository(IngestRequest(name="acme/after", location=str(one.path)))
        assert worker.proc.poll() is None
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text

    by_name = {e.repository: e for e in results}
    assert by_name["acme/broken"].status == "failed" and by_name["acme/broken"].reason == "not_found"
    assert "does not exist" in (by_name["acme/broken"].detail or "")
    for name in ("acme/one", "acme/two", "acme/one-slim"):
        assert by_name[name].status == "ingested", by_name[name]
    assert by_name["acme/one"].strategy == "parallel" and by_name["acme/one-slim"].strategy == "rewrite"
    assert after.manifest == by_name["acme/one"].manifest  # same content, same digest
    assert by_name["acme/one"].refs["refs/heads/main"] == one("rev-parse", "main").decode().strip()

    events = [IngestEvent.model_validate_json(m.value()) for m in read_all(settings, settings.topic("repo.events"),
                                                                               expect=5)]
    assert len(events) == 5
    assert [e.repository for e in events if e.status == "failed"] == ["acme/broken"]  # exactly one, no retries
    dlq = read_all(settings, settings.topic("repo.ingest.dlq"), expect=1)
    assert len(dlq) == 1 and dict(dlq[0].headers())["kiln-error-type"] == b"MalformedRequest"
    assert 'kiln_ingest_total{status="ingested"} 4.0' in metrics
    assert 'kiln_ingest_failures_total{reason="not_found"} 1.0' in metrics

    # The remote moves on; a rebuild into an empty store still reproduces what was ingested, digest for digest.
    write(one.path, "src/new.py", "new = True\n")
    one.commit("after ingestion")
    rebuilt = tmp_path / "rebuilt"
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "kiln.streams.cli", "replay", "repo.ingest",
                         "--from-beginning"],
        env={**os.environ, **env, "KILN_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
             "KILN_BLOB_STORE": f"file://{rebuilt}", "KILN_CACHE": str(tmp_path / "replay-cache")},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replayed 6 messages: 5 ok, 1 failed" in proc.stdout, proc.stdout
    store = SaucerStore(FileBlobStore(rebuilt), tmp_path / "reader-cache")
    assert store.names() == ["acme/after", "acme/one", "acme/one-slim", "acme/two"]
    for event in events:
        if event.status == "ingested":
            assert json.loads(store.blobs.get_name(f"saucer/repos/{event.repository}"))["manifest"] == event.manifest
    assert b"src/new.py" not in {e.path for e in store.repository("acme/one").walk("main")}
    assert len(read_all(settings, settings.topic("repo.events"), expect=5)) == 5  # no second round
