"""Where a decision takes effect. ``LocalBackend`` runs workers as processes on this machine (the real end-to-end
case: a new worker joins the consumer group, a removed one gets SIGTERM and finishes its jobs first);
``KedaBackend`` only records the minimum, which Kubernetes reads through KEDA's metrics-api scaler and combines with
its CPU trigger."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger("kiln.autoscale")


class Backend(Protocol):
    def current(self, stage: str) -> int:
        """Workers of ``stage`` running and not asked to stop."""

    def scale(self, stage: str, workers: int) -> None: ...

    def close(self) -> None: ...


class LocalBackend:
    """``kiln worker STAGE --slots N *extra`` processes, inheriting this process's environment; scaling down
    SIGTERMs the newest ones (their jobs finish and commit within the grace period, then they leave the group)."""

    def __init__(self, slots: int, extra: list[str], log_dir: Path, grace_s: float = 30.0) -> None:
        self.slots = slots
        self.extra = extra
        self.log_dir = log_dir
        self.grace_s = grace_s
        self._running: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._stopping: list[subprocess.Popen[bytes]] = []
        self.started = 0
        log_dir.mkdir(parents=True, exist_ok=True)

    def current(self, stage: str) -> int:
        alive = [p for p in self._running.get(stage, []) if p.poll() is None]
        for p in self._running.get(stage, []):
            if p.poll() is not None:
                log.warning("worker pid %d of %s exited with %s", p.pid, stage, p.returncode)
        self._running[stage] = alive
        self._stopping = [p for p in self._stopping if p.poll() is None]
        return len(alive)

    def scale(self, stage: str, workers: int) -> None:
        running = self._running.setdefault(stage, [])
        while len(running) < workers:
            self.started += 1
            out = (self.log_dir / f"{stage}-{self.started}.log").open("wb")
            running.append(subprocess.Popen(
                [sys.executable, "-m", "kiln.streams.cli", "worker", stage, "--slots", str(self.slots), *self.extra],
                stdout=out, stderr=subprocess.STDOUT))
        while len(running) > workers:
            process = running.pop()
            process.send_signal(signal.SIGTERM)
            self._stopping.append(process)

    def close(self) -> None:
        """SIGTERM every worker and wait for them (SIGKILL after the grace period)."""
        for processes in self._running.values():
            for p in processes:
                p.send_signal(signal.SIGTERM)
                self._stopping.append(p)
        self._running.clear()
        deadline = time.monotonic() + self.grace_s + 15
        for p in self._stopping:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self._stopping.clear()


class KedaBackend:
    """The minimum per stage, served at ``/keda/<stage>`` as ``{"desired": n}`` (KEDA metrics-api trigger with
    ``valueLocation: desired`` and ``targetValue: "1"``); Kubernetes runs the pods.

    The current count the decision starts from is the minimum last served, not the pods running: those lag behind
    it (the HPA's scale-down window) or exceed it (KEDA's CPU trigger), and a minimum that echoed them back would
    hold them up forever -- each scale-down would last one tick, and the HPA keeps the highest recommendation of its
    window. Before the first decision the workers the heartbeats show (``seen``) stand in, so a restarted
    autoscaler lowers the minimum of running pods only after its ``down_ticks``."""

    def __init__(self) -> None:
        self.desired: dict[str, int] = {}
        self.seen: dict[str, int] = {}

    def current(self, stage: str) -> int:
        return self.desired.get(stage, self.seen.get(stage, 0))

    def scale(self, stage: str, workers: int) -> None:
        self.desired[stage] = workers

    def close(self) -> None:
        return
