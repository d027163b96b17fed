"""Helpers for runtime tests: run workers in-process, read topics, read journals. (Workers as real processes:
``kiln.streams.processes.WorkerProcess``.)"""

from __future__ import annotations

import asyncio
import contextlib
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
