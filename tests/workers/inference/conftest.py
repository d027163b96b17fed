"""Inference tests run ``kiln rl serve`` as real processes on loopback ports; torch comes from the ``rl`` extra
(infra/bootstrap.sh installs it; without it these tests are not collected)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.collection import unless_importable

if TYPE_CHECKING:
    from kiln.workers.inference.model import ModelConfig
    from kiln.workers.inference.process import ServerProcess

# KILN_RL=0: no rl environment; the root conftest lists what was left out (tests/collection.py).
collect_ignore_glob = unless_importable(__file__, "torch", "test_*.py", "needs the rl extra: torch")


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
