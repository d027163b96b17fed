"""Heartbeats carry the stage's own gauges; a stage whose gauges fail still beats (with none); a stopped worker
leaves a tombstone."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from kiln.schemas.ops import WorkerHeartbeat
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import WORKERS_TOPIC
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
                found = await asyncio.to_thread(read_all, settings, settings.topic(WORKERS_TOPIC))
                if len([m for m in found if m.key() == worker.worker_id.encode() and m.value()]) >= 2:
                    break
    records = read_all(settings, settings.topic(WORKERS_TOPIC))
    beats = {i: [WorkerHeartbeat.model_validate_json(m.value()) for m in records
                 if m.key() == i.encode() and m.value() is not None] for i in ids}
    assert beats[ids[0]] and all(b.gauges == levels for b in beats[ids[0]])
    assert beats[ids[1]] and all(b.gauges == {} and b.slots == 2 for b in beats[ids[1]])
    assert [m.value() for m in records if m.key() == ids[0].encode()][-1] is None  # the tombstone
