"""Helpers for runtime tests: run workers in-process or as real subprocesses, read topics, read journals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from kiln.streams.runtime import Worker
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import Stage


@contextlib.asynccontextmanager
async def running_worker(stage: Stage, settings: KilnSettings, topic: str, **kwargs: Any) -> AsyncIterator[Worker]:
    worker = Worker(stage, settings, topic=topic, group_id=f"g-{topic}", **kwargs)
    task = asyncio.create_task(worker.run())
    try:
        deadline = time.monotonic() + 30
        while not worker.ready.is_set():
            assert time.monotonic() < deadline, "worker did not join its group"
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, 60)


class WorkerProcess:
    """``kiln worker`` as a real process: what a preemptible node runs."""

    def __init__(self, stage: str, settings: KilnSettings, topic: str, *, slots: int, journal: Path | None = None,
                 grace_s: float = 30.0, extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        proc_env = {**os.environ, **(env or {}), "KILN_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
                    "KILN_GRACE_S": str(grace_s), "KILN_BLOB_STORE": f"file://{settings.cache / 'blobs'}"}
        if journal is not None:
            proc_env["KILN_SLEEP_JOURNAL"] = str(journal)
        self.log = Path(f"/tmp/kiln-test-worker-{topic}-{time.monotonic_ns()}.log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.streams.cli", "worker", stage, "--slots", str(slots), "--topic", topic,
             "--group", f"g-{topic}", *(extra or [])],
            env=proc_env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
        )

    def wait_assigned(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while "assigned" not in self.log.read_text() and "queue mode" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "worker did not get partitions:\n" + self.log.read_text()
            time.sleep(0.1)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()


def read_all(settings: KilnSettings, topic: str, expect: int, timeout: float = 30) -> list[Any]:
    """Every record of ``topic`` from the start (at least ``expect`` of them, or whatever came in time)."""
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"reader-{time.time_ns()}",
                         "enable.auto.commit": False})
    md = consumer.list_topics(topic, timeout=10).topics[topic]
    consumer.assign([TopicPartition(topic, p, 0) for p in md.partitions])
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < expect and time.monotonic() < deadline:
        for msg in consumer.consume(100, 0.2):
            if msg.error() is None:
                got.append(msg)
    consumer.close()
    return got


def journal_events(path: Path) -> list[tuple[str, str, str]]:
    if not path.exists():
        return []
    return [tuple(line.split()[:3]) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]
