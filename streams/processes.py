"""``kiln worker`` as a real local process, and free loopback ports: what tests, benches and local deployments use
to run workers the way a node runs them (own process, own consumer, SIGTERM for a graceful stop, SIGKILL for a
preemption)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kiln.streams.errors import InfraError
from kiln.streams.settings import KilnSettings


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerProcess:
    """One ``kiln worker STAGE`` process consuming ``topic`` with group ``group`` (default ``g-<topic>``); its
    output goes to ``log``. ``launcher``: a command that execs the rest where the worker should run (e.g. in a worker
    node, ``infra/nodes/nodes.sh run N``), keeping its pid."""

    def __init__(self, stage: str, settings: KilnSettings, topic: str, *, slots: int, journal: Path | None = None,
                 grace_s: float = 30.0, extra: list[str] | None = None, env: dict[str, str] | None = None,
                 group: str | None = None, launcher: list[str] | None = None) -> None:
        proc_env = {**os.environ, "KILN_BOOTSTRAP_SERVERS": settings.bootstrap_servers, "KILN_GRACE_S": str(grace_s),
                    "KILN_BLOB_STORE": f"file://{settings.cache / 'blobs'}", **(env or {})}
        if journal is not None:
            proc_env["KILN_SLEEP_JOURNAL"] = str(journal)
        self.log = Path(tempfile.gettempdir()) / f"kiln-worker-{topic}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [*(launcher or []), sys.executable, "-m", "kiln.streams.cli", "worker", stage, "--slots", str(slots),
             "--topic", topic, "--group", group or f"g-{topic}", *(extra or [])],
            env=proc_env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
        )

    def wait_assigned(self, timeout: float = 60) -> None:
        """Until the worker has partitions (group mode) or has joined its share group (queue mode)."""
        deadline = time.monotonic() + timeout
        while "assigned" not in (text := self.log.read_text()) and "queue mode" not in text:
            if self.proc.poll() is not None:
                raise InfraError(f"worker exited with {self.proc.returncode}:\n{text}")
            if time.monotonic() > deadline:
                raise InfraError(f"worker did not get partitions in {timeout:g}s:\n{text}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a preempted node."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait for the graceful stop; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60) -> None:
        """Graceful stop if it is running, SIGKILL when the grace runs out."""
        if self.proc.poll() is None:
            try:
                self.terminate(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    @staticmethod
    def stop_all(workers: list[WorkerProcess], timeout: float = 60) -> None:
        """Graceful stop of several at once (SIGTERM to all, then one shared grace), SIGKILL for stragglers."""
        running = [w for w in workers if w.proc.poll() is None]
        for worker in running:
            worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in running:
            try:
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, name: str, timeout: float) -> None:
    """Until the process's ``url/healthz`` answers 200; ``InfraError`` with its log's tail if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InfraError(f"{name} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise InfraError(f"{name} not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


class ServiceProcess:
    """A kiln HTTP service (``kiln ... serve``) as a real process on a free loopback port; SIGTERM stops it."""

    def __init__(self, argv: list[str], port_variable: str, settings: KilnSettings, log: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.streams.cli", *argv],
            env={**os.environ, "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache),
                 port_variable: str(self.port), **env},
            stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.name = " ".join(argv)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise InfraError(f"kiln {self.name} exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")

    def wait_healthy(self, timeout: float = 60) -> None:
        """Until ``/healthz`` answers 200."""
        wait_healthy(self.proc, self.url, self.log, f"kiln {self.name}", timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class StatsProcess(ServiceProcess):
    """``kiln stats serve`` publishing every second on a free port, with its numbers read over HTTP."""

    def __init__(self, settings: KilnSettings, log: Path, **env: str) -> None:
        super().__init__(["stats", "serve", "--verbose"], "KILN_STATS_PORT", settings, log,
                         **{"KILN_STATS_PUBLISH_S": "1", **env})

    def stage(self, stage: str) -> dict[str, Any]:
        try:
            response = httpx.get(f"{self.url}/stats/{stage}", timeout=5)
        except httpx.HTTPError:
            return {}
        return dict(response.json()) if response.status_code == 200 else {}

    def wait(self, stage: str, check: Callable[[dict[str, Any]], bool], timeout: float = 45) -> dict[str, Any]:
        """The stage's numbers once ``check`` holds for them."""
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            seen = self.stage(stage)
            if seen and check(seen):
                return seen
            time.sleep(0.5)
        raise InfraError(f"stats for {stage} never matched; last: {seen}")
