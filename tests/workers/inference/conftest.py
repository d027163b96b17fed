"""Inference tests run ``kiln rl serve`` as real processes on loopback ports; torch comes from the ``rl`` extra
(infra/bootstrap.sh installs it; without it these tests are not collected)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kiln.workers.inference.model import ModelConfig
    from kiln.workers.inference.process import ServerProcess

if importlib.util.find_spec("torch") is None:  # KILN_RL=0: no rl environment
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``serve(config, **env)``: a running server; stopped after the test."""
    from kiln.workers.inference.process import ServerProcess

    started: list[ServerProcess] = []

    def make(config: ModelConfig | None = None, **env: str) -> ServerProcess:
        from kiln.workers.inference.model import ModelConfig

        served = ServerProcess(config or ModelConfig(), tmp_path / f"serve-{len(started)}.log", env)
        started.append(served)
        served.start()
        return served

    yield make
    for served in started:
        served.stop()
