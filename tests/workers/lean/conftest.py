"""Lean workers run every REPL in bubblewrap: the sandbox is installed once per session, as `kiln setup` does."""

from __future__ import annotations

import pytest

from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from tests.conftest import _ensure
from tests.stages import worker_env
from tests.workers.lean.fake import FAKE_COMMAND


@pytest.fixture(scope="session", autouse=True)
def lean_sandbox() -> None:
    _ensure("lean")


def lean_worker(settings: KilnSettings, slots: int, port: int, **env: str) -> WorkerProcess:
    return WorkerProcess("lean", settings, "lean.requests", slots=slots,
                         env=worker_env(settings, KILN_LEAN_REPL=FAKE_COMMAND, KILN_METRICS_PORT=str(port), **env))
