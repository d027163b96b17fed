"""Replay a request topic from offset 0 through a stage's handler, to rebuild derived state.

Replay reads every partition from the beginning up to the end offsets seen at start, outside any consumer group
(nothing is committed, live workers are untouched). Results and dead-letter records are never re-emitted: they
reached their readers the first time. A stage declares what else a replay must not repeat by checking
``ctx.replay`` in its handler (e.g. Saucer rebuilds its store but publishes no second round of events).
Stages with keyed ordering see a key's records in offset order, as they did live.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kiln.streams import codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import ConfigError, MalformedRequest
from kiln.streams.infra import console
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.middleware import Job, default_middleware, stage_chain
from kiln.streams.offsets import coordinates
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import JobContext, Stage


@dataclass
class ReplayStats:
    messages: int = 0
    ok: int = 0
    failed: int = 0
    malformed: int = 0


def _open_to_end(settings: KilnSettings, name: str) -> tuple[Consumer, dict[int, int], int]:
    """A consumer assigned to every non-empty partition of ``name`` from the start; the end offsets seen now and
    the number of records before them."""
    consumer = Consumer(settings.kafka(**{"group.id": f"kiln-replay-{uuid.uuid4().hex[:8]}",
                                          "enable.auto.commit": False, "enable.partition.eof": True,
                                          "auto.offset.reset": "earliest"}))
    md = consumer.list_topics(name, timeout=15).topics.get(name)
    if md is None or md.error is not None:
        consumer.close()
        raise ConfigError(f"topic {name} does not exist")
    ends: dict[int, int] = {}
    total = 0
    for p in md.partitions:
        low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=15)
        if high > low:
            ends[p] = high
            total += high - low
    consumer.assign([TopicPartition(name, p, 0) for p in ends])
    return consumer, ends, total


def records_until_end(consumer: Consumer, ends: dict[int, int], max_batch: int = 500,
                      until_ms: int | None = None) -> list[Message]:
    """The next batch of records before the end offsets (and, with ``until_ms``, no later than that broker time);
    drops partitions from ``ends`` as they reach them. Call until ``ends`` is empty."""
    batch: list[Message] = []
    for msg in consumer.consume(max_batch, 0.2):
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                ends.pop(msg.partition() or 0, None)
            continue
        _, p, offset = coordinates(msg)
        if p not in ends:
            continue
        if until_ms is not None and msg.timestamp()[1] > until_ms:
            del ends[p]  # broker time only grows along a partition (LogAppendTime)
            continue
        if offset < ends[p]:
            batch.append(msg)
        if offset >= ends[p] - 1:
            del ends[p]
    return batch


def read_topic(settings: KilnSettings, topic: str) -> list[Message]:
    """Every record ``topic`` holds now, from the start (e.g. the events a replay must not repeat)."""
    consumer, ends, _ = _open_to_end(settings, settings.topic(topic))
    records: list[Message] = []
    try:
        while ends:
            records.extend(records_until_end(consumer, ends))
    finally:
        consumer.close()
    return records


def _forget_if_last(last_of_key: dict[bytes | None, asyncio.Task[None]], key: bytes | None,
                    task: asyncio.Task[None]) -> None:
    if last_of_key.get(key) is task:
        del last_of_key[key]


async def replay(stage: Stage, settings: KilnSettings, topic: str | None = None, *, concurrency: int = 8,
                 blob_store: BlobStore | None = None, show_progress: bool = True) -> ReplayStats:
    name = settings.topic(topic or stage.spec.request_topic)
    consumer, remaining, total = _open_to_end(settings, name)

    stats = ReplayStats()
    metrics = WorkerMetrics(stage.name, "replay")

    chain = stage_chain(stage, default_middleware(metrics, settings.job_timeout_s), blob_store)
    gate = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()

    keyed = stage.spec.ordering == "keyed"
    last_of_key: dict[bytes | None, asyncio.Task[None]] = {}

    async def run_one(value: bytes | None, partition: int, offset: int, after: asyncio.Task[None] | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        async with gate:
            try:
                envelope = codec.decode_request(value)
            except MalformedRequest:
                stats.malformed += 1
                return
            ctx = JobContext(envelope=envelope, attempt=0, worker_id="replay", topic=name, partition=partition,
                             offset=offset, replay=True)
            outcome = await chain(Job(stage, ctx))
            if outcome.status == "ok":
                stats.ok += 1
            else:
                stats.failed += 1

    progress = Progress(TextColumn(f"replay {name}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        console=console, disable=not show_progress)
    with progress:
        bar = progress.add_task("replay", total=total)
        while remaining:
            for msg in await asyncio.to_thread(records_until_end, consumer, remaining):
                _, p, offset = coordinates(msg)
                stats.messages += 1
                after = last_of_key.get(msg.key()) if keyed else None
                task = asyncio.create_task(run_one(msg.value(), p, offset, after))
                if keyed:
                    key = msg.key()
                    last_of_key[key] = task
                    task.add_done_callback(functools.partial(_forget_if_last, last_of_key, key))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _t: progress.advance(bar))
            # Back-pressure: never hold more than a few batches of pending jobs.
            while len(tasks) > concurrency * 4:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if tasks:
            await asyncio.wait(tasks)
    consumer.close()
    return stats
