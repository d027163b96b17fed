"""A rollout stage with exec rewards, as an actor reaches it: kiln's inference server, an exec worker and a rollout
worker on the test's topics, and the actor's client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.model import ModelConfig
from kiln.workers.inference.process import ServerProcess
from tests.stages import worker_env
from tests.workers.exec.conftest import exec_worker


@contextlib.asynccontextmanager
async def rollout_with_exec(settings: KilnSettings, tmp_path: Path, unique: str) -> AsyncIterator[KilnClient]:
    """The actor's client of a rollout worker sampling from a character model, its rewards from an exec worker."""
    server = ServerProcess(ModelConfig(max_len=64), tmp_path / "serve.log")
    server.start()
    env = worker_env(settings, KILN_ROLLOUT_ENDPOINTS=json.dumps([server.url]))
    try:
        with exec_worker(settings, tmp_path / "locks") as ex, \
                WorkerProcess("rollout", settings, "rollout.requests", slots=2, env=env) as worker:
            ex.wait_assigned()
            worker.wait_assigned()
            async with KilnClient(settings, f"actor-{unique}") as client:
                yield client
            worker.stop()
    finally:
        server.stop()
