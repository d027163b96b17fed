"""``kiln rl serve`` as a child process on a loopback port: for tests, benches and single-machine runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kiln.streams.processes import free_port, wait_healthy
from kiln.workers.inference.endpoints import KilnEndpoint
from kiln.workers.inference.model import ModelConfig


@dataclass
class ServerProcess:
    """One server process; ``restart()`` brings it back on the same port with its initial weights. ``env`` adds
    ``KILN_RL_*`` settings (the model's shape comes from ``config``)."""

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
        return KilnEndpoint(self.url, admin_token=self.token, timeout_s=timeout_s)

    def start(self, patience_s: float = 120.0) -> None:
        c = self.config
        env = {**os.environ, "OMP_NUM_THREADS": "1", "KILN_RL_ADMIN_TOKEN": self.token,
               "KILN_RL_D_MODEL": str(c.d_model), "KILN_RL_N_LAYERS": str(c.n_layers),
               "KILN_RL_N_HEADS": str(c.n_heads), "KILN_RL_MAX_LEN": str(c.max_len), "KILN_RL_SEED": str(c.seed),
               **self.env}
        kiln = Path(sys.executable).parent / "kiln"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([str(kiln), "rl", "serve", "--port", str(self.port)], env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.url, self.log, "kiln rl serve", patience_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies only once continued
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL after 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def weights(self) -> dict[str, object]:
        """The server's policy version and weights digest (``GET /weights``)."""
        answer = httpx.get(f"{self.url}/weights", headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        answer.raise_for_status()
        result: dict[str, object] = answer.json()
        return result

    def metric(self, name: str) -> float:
        """One unlabelled counter or gauge from ``/metrics``."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        return 0.0

