"""Exec tests share one built project image and run real exec workers on per-test topics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits
from tests.workers.builder.projects import python_project
from tests.workers.conftest import worker_env


@pytest.fixture(scope="session")
def project_image(docker_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("exec-image")
    store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
    python_project(root / "src")
    assert asyncio.run(ingest(IngestRequest(name="demo/exec", location=str(root / "src")), "r", store,
                              root / "w")).status == "ingested"
    event = asyncio.run(build_revision(BuildRequest(repository="demo/exec"), store, docker_engine,
                                       BaseImages("kiln/base:latest", "kiln/toolchain:latest"), root / "w",
                                       Limits(timeout_s=300)))
    assert event.usable and event.image, event.detail
    return event.image


@pytest.fixture
def exec_settings(stage_topics: Callable[..., KilnSettings]) -> KilnSettings:
    return stage_topics(("exec.requests", 4))


def exec_worker(settings: KilnSettings, lock_dir: Path, **env: str) -> WorkerProcess:
    return WorkerProcess("exec", settings, "exec.requests", slots=4, env=worker_env(
        settings, KILN_EXEC_LOCK_DIR=str(lock_dir), KILN_EXEC_REAP_INTERVAL_S="1", KILN_EXEC_WARM="1",
        KILN_METRICS_PORT=str(free_port()), **env))


@pytest.fixture
def worker(exec_settings: KilnSettings, tmp_path: Path) -> Iterator[WorkerProcess]:
    with exec_worker(exec_settings, tmp_path / "locks") as w:
        w.wait_assigned()
        yield w


def session_containers(docker: Any) -> list[Any]:
    return list(docker.containers.list(all=True, filters={"label": "kiln.role=exec-session"}))
