"""Heartbeats carry the stage's own gauges; a stage whose gauges fail still beats (with none); a stopped worker
leaves a tombstone."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from confluent_kafka import Producer

from kiln.schemas.ops import WorkerHeartbeat
from kiln.streams import admin
from kiln.streams.processes import StatsProcess
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import COMPACTED, HEARTBEATS_TOPIC, LEGACY_HEARTBEATS_TOPIC, TopicSpec
from kiln.streams.status.view import OpsView
from kiln.workers.builtin import sleep
from tests.streams.harness import read_all, running_worker


def _broken() -> dict[str, float]:
    raise RuntimeError("gauge source gone")


async def test_heartbeats_carry_stage_gauges(ops_topics: Callable[..., KilnSettings]) -> None:
    settings = ops_topics(("sleep.a", 1), ("sleep.b", 1)).model_copy(update={"heartbeat_s": 0.5})
    levels = {"sessions_open": 3.0, "repl_processes[import A]": 2.0}
    reporting = dataclasses.replace(sleep.stage, gauges=lambda: levels)
    failing = dataclasses.replace(sleep.stage, gauges=_broken)
    ids = []
    for stage, topic in ((reporting, "sleep.a"), (failing, "sleep.b")):
        async with running_worker(stage, settings, topic, slots=2) as worker:
            ids.append(worker.worker_id)
            for _ in range(60):  # until two beats of this worker are on the topic
                await asyncio.sleep(0.5)
                found = await asyncio.to_thread(read_all, settings, settings.topic(HEARTBEATS_TOPIC))
                if len([m for m in found if m.key() == worker.worker_id.encode() and m.value()]) >= 2:
                    break
    records = read_all(settings, settings.topic(HEARTBEATS_TOPIC))
    beats = {i: [WorkerHeartbeat.model_validate_json(m.value()) for m in records
                 if m.key() == i.encode() and m.value() is not None] for i in ids}
    assert beats[ids[0]] and all(b.gauges == levels for b in beats[ids[0]])
    assert beats[ids[1]] and all(b.gauges == {} and b.slots == 2 for b in beats[ids[1]])
    assert [m.value() for m in records if m.key() == ids[0].encode()][-1] is None  # the tombstone


def test_the_status_view_still_reads_heartbeats_from_the_legacy_topic(
        ops_topics: Callable[..., KilnSettings]) -> None:
    """During a rolling upgrade, workers of the release before publish to ``kiln.workers``: the view reads both."""
    settings = ops_topics(("sleep.requests", 1))
    legacy = settings.topic(LEGACY_HEARTBEATS_TOPIC)
    admin.create_topics(settings, [TopicSpec(LEGACY_HEARTBEATS_TOPIC, 1, COMPACTED)])
    producer = Producer(settings.kafka())
    for worker, topic in (("old-worker", legacy), ("new-worker", settings.topic(HEARTBEATS_TOPIC))):
        beat = WorkerHeartbeat(worker=worker, stage="sleep", topic="sleep.requests", group="kiln.sleep", slots=2,
                               busy=0, state="ok", interval_s=5, at=time.time())
        producer.produce(topic, beat.model_dump_json().encode(), key=worker.encode())
    assert producer.flush(30) == 0
    view = OpsView(settings).start()
    try:
        assert view.caught_up.wait(30)
        assert sorted(b.worker for b in view.alive()) == ["new-worker", "old-worker"]
    finally:
        view.stop()


def test_the_stats_stream_counts_workers_beating_on_the_legacy_topic(
        ops_topics: Callable[..., KilnSettings], stats_process: Callable[..., StatsProcess]) -> None:
    settings = ops_topics(("sleep.requests", 1))
    admin.create_topics(settings, [TopicSpec(LEGACY_HEARTBEATS_TOPIC, 1, COMPACTED)])  # there before the app starts
    beat = WorkerHeartbeat(worker="old-worker", stage="sleep", topic=settings.topic("sleep.requests"),
                           group="kiln.sleep", slots=3, busy=1, state="ok", interval_s=60, at=time.time())
    producer = Producer(settings.kafka())
    producer.produce(settings.topic(LEGACY_HEARTBEATS_TOPIC), beat.model_dump_json().encode(), key=b"old-worker")
    assert producer.flush(30) == 0
    numbers = stats_process(settings).wait("sleep", lambda s: s["workers_now"] == 1)
    assert numbers["slots_now"] == 3 and numbers["busy_now"] == 1
