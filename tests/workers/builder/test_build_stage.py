"""The ``build`` stage on the broker: events on image.events, failure metrics, and ``kiln builds failures``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.common.registry import Registry
from tests.ingest.gitrepos import git, write
from tests.stages import worker_env
from tests.streams.harness import read_all
from tests.workers.builder.projects import PROJECTS


@pytest.mark.docker
async def test_build_stage_publishes_events_and_the_failure_table(stage_topics: Callable[..., KilnSettings],
                                                                  docker_engine: Any, tmp_path: Path) -> None:
    settings = stage_topics(("image.build", 2), ("image.events", 1))
    store = SaucerStore(FileBlobStore(settings.cache / "blobs"), tmp_path / "reader")
    names = ["python", "broken-compile", "no-rule"]
    for name in names:
        PROJECTS[name](tmp_path / name)
        assert (await ingest(IngestRequest(name=f"demo/{name}", location=str(tmp_path / name)), name, store,
                             tmp_path / "work")).status == "ingested"
    port = free_port()
    env = worker_env(settings, KILN_METRICS_PORT=str(port))
    with WorkerProcess("build", settings, "image.build", slots=2, env=env) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, "builder-client") as client:
            events: list[BuildEvent] = await asyncio.gather(*(
                client.call("build", BuildRequest(repository=f"demo/{n}"), key=f"demo/{n}") for n in names))
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    assert [(e.status, e.failure) for e in events] == [("built", None), ("failed", "compile_failed"),
                                                       ("failed", "no_rule_matched")]
    published = [BuildEvent.model_validate_json(m.value())
                 for m in read_all(settings, settings.topic("image.events"), expect=3)]
    assert sorted(e.repository for e in published) == sorted(f"demo/{n}" for n in names)  # once each
    assert 'kiln_build_failures_total{reason="compile_failed",system="go"} 1.0' in metrics
    table = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "kiln.streams.cli", "builds", "failures"],
        env={**os.environ, **env, "KILN_BOOTSTRAP_SERVERS": settings.bootstrap_servers, "COLUMNS": "200"},
        capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "compile_failed" in table.stdout and "no_rule_matched" in table.stdout and "go" in table.stdout


@pytest.mark.docker
@pytest.mark.registry
@pytest.mark.timeout(900)  # on a fresh machine the first base push uploads the toolchain layers to S3
async def test_layered_builds_through_the_stage(stage_topics: Callable[..., KilnSettings], docker_engine: Any,
                                                registry: Registry, tmp_path: Path) -> None:
    settings = stage_topics(("image.build", 1), ("image.events", 1))
    store = SaucerStore(FileBlobStore(settings.cache / "blobs"), tmp_path / "reader")
    b = PROJECTS["python"](tmp_path / "src")
    first = git(tmp_path / "src", "rev-parse", "HEAD").decode().strip()
    write(tmp_path / "src", "calc/more.py", "def more(x):\n    return x + 1\n")
    second = b.commit("one more module")
    assert (await ingest(IngestRequest(name="demo/layered-stage", location=str(tmp_path / "src")), "r", store,
                         tmp_path / "work")).status == "ingested"
    env = worker_env(settings, KILN_METRICS_PORT=str(free_port()), KILN_BUILD_REGISTRY=registry.address,
                     KILN_BUILD_REGISTRY_USER=registry.user, KILN_BUILD_REGISTRY_PASSWORD=registry.password)
    with WorkerProcess("build", settings, "image.build", slots=1, env=env) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, "builder-client") as client:
            events = [await client.call("build", BuildRequest(repository="demo/layered-stage", revision=c,
                                                              layered=True), key="demo/layered-stage")
                      for c in (first, second)]
    assert [(e.revision_image, e.usable) for e in events] == [("base", True), ("layer", True)]
    assert events[1].parent_commit == first and events[1].image and "@sha256:" in events[1].image
    assert events[1].tests is not None and events[1].tests.passed == 2
