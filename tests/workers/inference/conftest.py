"""Inference tests run ``kiln rl serve`` as real processes on loopback ports; torch comes from the ``rl`` extra
(infra/bootstrap.sh installs it; without it these tests are not collected)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

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


CORPUS = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)] + ["def add(a, b):\n    return a + b\n"] * 20


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``hf_model(arch, seed=0)``: the directory of a tiny Hugging Face causal LM (``hf.build_tiny_model``: a
    tokenizer trained here, random init), built once per session."""
    from kiln.workers.inference.hf import build_tiny_model

    built: dict[tuple[str, int], Path] = {}

    def make(arch: Literal["llama", "qwen2"] = "llama", seed: int = 0) -> Path:
        if (arch, seed) not in built:
            out = tmp_path_factory.mktemp(f"hf-{arch}-{seed}")
            built[arch, seed] = build_tiny_model(out, CORPUS, arch=arch, seed=seed)
        return built[arch, seed]

    return make
