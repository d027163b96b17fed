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


def read_all(settings: KilnSettings, topic: str, expect: int = 0, timeout: float = 30) -> list[Any]:
    """Every record of ``topic``, from the start to its end offsets, once it holds at least ``expect`` records
    (waiting up to ``timeout`` for them). Records beyond ``expect`` are returned too: callers assert exact counts,
    so a duplicate cannot hide behind a reader that stopped early."""
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"reader-{time.time_ns()}",
                         "enable.auto.commit": False})
    try:
        md = consumer.list_topics(topic, timeout=10).topics[topic]
        deadline = time.monotonic() + timeout
        while True:
            marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in md.partitions}
            if sum(high - low for low, high in marks.values()) >= expect or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        ends = {p: high for p, (low, high) in marks.items() if high > low}
        consumer.assign([TopicPartition(topic, p, marks[p][0]) for p in ends])
        got: list[Any] = []
        while ends and time.monotonic() < deadline + 30:
            for msg in consumer.consume(500, 0.2):
                if msg.error() is None:
                    got.append(msg)
                    if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                        ends.pop(msg.partition(), None)
        assert not ends, f"could not read {topic} to its end offsets"
        return got
    finally:
        consumer.close()


def committed_position(settings: KilnSettings, group: str, topic: str, partition: int = 0) -> TopicPartition:
    """What ``group`` has committed on ``topic``'s ``partition``: offset (negative: none) and metadata."""
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": group})
    try:
        position: TopicPartition = consumer.committed([TopicPartition(topic, partition)], timeout=10)[0]
        return position
    finally:
        consumer.close()


def committed(settings: KilnSettings, group: str, topic: str, partition: int = 0) -> int:
    """The offset ``group`` has committed on ``topic``'s ``partition`` (negative: none)."""
    return int(committed_position(settings, group, topic, partition).offset)


def journal_events(path: Path) -> list[tuple[str, str, str]]:
    if not path.exists():
        return []
    return [tuple(line.split()[:3]) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]
