"""Exec tests share one built project image (``project_image``, tests/workers/conftest.py) and run real exec
workers on per-test topics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from tests.stages import worker_env


@pytest.fixture
def exec_settings(stage_topics: Callable[..., KilnSettings]) -> KilnSettings:
    return stage_topics(("exec.requests", 4))


def exec_worker(settings: KilnSettings, lock_dir: Path, **env: str) -> WorkerProcess:
    env.setdefault("KILN_METRICS_PORT", str(free_port()))
    return WorkerProcess("exec", settings, "exec.requests", slots=4, env=worker_env(
        settings, KILN_EXEC_LOCK_DIR=str(lock_dir), KILN_EXEC_REAP_INTERVAL_S="1", KILN_EXEC_WARM="1", **env))


@pytest.fixture
def worker(exec_settings: KilnSettings, tmp_path: Path) -> Iterator[WorkerProcess]:
    with exec_worker(exec_settings, tmp_path / "locks") as w:
        w.wait_assigned()
        yield w


def session_containers(docker: Any) -> list[Any]:
    return list(docker.containers.list(all=True, filters={"label": "kiln.role=exec-session"}))
