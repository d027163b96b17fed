"""Inference tests run ``kiln rl serve`` as real processes on loopback ports; torch comes from the ``rl`` extra
(infra/bootstrap.sh installs it; without it these tests skip)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from kiln.workers.inference.endpoints import KilnEndpoint
    from kiln.workers.inference.model import ModelConfig

if importlib.util.find_spec("torch") is None:  # KILN_RL=0: no rl environment
    collect_ignore_glob = ["test_*.py"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    """One ``kiln rl serve`` process; ``restart()`` brings it back on the same port with fresh weights."""

    config: ModelConfig
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self, timeout_s: float = 60.0) -> KilnEndpoint:
        from kiln.workers.inference.endpoints import KilnEndpoint

        return KilnEndpoint(self.url, admin_token=self.token, timeout_s=timeout_s)

    def start(self) -> None:
        c = self.config
        env = {**os.environ, "OMP_NUM_THREADS": "1", "KILN_RL_ADMIN_TOKEN": self.token,
               "KILN_RL_D_MODEL": str(c.d_model), "KILN_RL_N_LAYERS": str(c.n_layers),
               "KILN_RL_N_HEADS": str(c.n_heads), "KILN_RL_MAX_LEN": str(c.max_len), "KILN_RL_SEED": str(c.seed),
               **self.env}
        kiln = Path(sys.executable).parent / "kiln"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([str(kiln), "rl", "serve", "--port", str(self.port)], env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln rl serve exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kiln rl serve did not answer: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def weights(self) -> dict[str, object]:
        answer = httpx.get(f"{self.url}/weights", headers={"Authorization": f"Bearer {self.token}"}, timeout=30)
        answer.raise_for_status()
        result: dict[str, object] = answer.json()
        return result


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """``serve(config, **env)``: a running server; stopped after the test."""
    started: list[Served] = []

    def make(config: ModelConfig | None = None, **env: str) -> Served:
        from kiln.workers.inference.model import ModelConfig

        served = Served(config or ModelConfig(), tmp_path / f"serve-{len(started)}.log", env)
        started.append(served)
        served.start()
        return served

    yield make
    for served in started:
        if served.proc is not None and served.proc.poll() is None:
            served.proc.terminate()
            try:
                served.proc.wait(15)
            except subprocess.TimeoutExpired:
                served.kill()
