"""Fairness: does a flooding client slow down a light one?

Parameters: one ``sleep`` worker, 8 slots, at most 1 job in flight per partition, 16 partitions. The light client
offers one 20 ms job every 100 ms, open loop (whatever its earlier jobs do): 6 s alone, then from the moment the
flooding client has dumped 4,000 20 ms jobs at once (client-salted keys over 4 partitions) until the flood is
served (at most 60 s), so every light job measured under the flood was sent while flood jobs were queued.
Requests are partitioned by client (librdkafka hashes keys with CRC32). Two cases, each on fresh topics, with
client ids chosen so that:
- ``disjoint``: the light client's partition is none of the flood's (more partitions than active clients);
- ``colliding``: the light client's partition is one of the flood's (the hard case: in the log, its jobs sit
  behind the flood's).
``fair_share_ratio_<case>`` = the light client's median latency with the flood / alone (aim <= 2).
Usage: python bench/fairness.py
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections.abc import Callable

from bench.common import broker, fresh_topics, median, percentile, report
from kiln.schemas.builtin import SleepRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings

PARTITIONS, SPREAD = 16, 4


def partitions_of(client_id: str, spread: int) -> set[int]:
    return {zlib.crc32(f"{client_id}/{i}".encode()) % PARTITIONS for i in range(spread)}


async def light_run(client: KilnClient, topic: str, until: Callable[[], bool], limit_s: float) -> list[float]:
    """Latencies (ms) of jobs offered every 100 ms until ``until()`` or ``limit_s``."""
    latencies: list[float] = []

    async def one() -> None:
        t0 = time.monotonic()
        await client.call("sleep", SleepRequest(seconds=0.02), topic=topic)
        latencies.append((time.monotonic() - t0) * 1000)

    tasks, started = [], time.monotonic()
    while not until() and time.monotonic() - started < limit_s:
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(0.1)
    await asyncio.gather(*tasks)
    return latencies


async def scenario(settings: KilnSettings, colliding: bool) -> tuple[list[float], list[float], int]:
    """The light client's latencies alone and under the flood, and the flood jobs still queued when the light run
    stopped (0 unless it hit its time limit)."""
    topic, results = fresh_topics(settings, "fair", PARTITIONS)
    flood_id = f"flood-{uuid.uuid4().hex[:6]}"
    light_id = next(c for c in (f"light-{uuid.uuid4().hex[:6]}" for _ in range(1000))
                    if partitions_of(c, 1).isdisjoint(partitions_of(flood_id, SPREAD)) != colliding)
    worker = WorkerProcess("sleep", settings, topic, slots=8, extra=["--per-partition", "1"])
    try:
        worker.wait_assigned()
        async with KilnClient(settings, light_id, results_topic=results, key_spread=1) as light, \
                KilnClient(settings, flood_id, results_topic=results, key_spread=SPREAD,
                           max_in_flight=100_000) as flood:
            alone = await light_run(light, topic, lambda: False, 6.0)
            flood_futures = [await flood.submit("sleep", SleepRequest(seconds=0.02), topic=topic)
                             for _ in range(4000)]
            contended = await light_run(light, topic, lambda: all(f.done() for f in flood_futures), 60.0)
            backlog_left = sum(not f.done() for f in flood_futures)
            await asyncio.gather(*flood_futures)
    finally:
        worker.stop()
    return alone, contended, backlog_left


async def main() -> None:
    settings = broker()
    metrics: dict[str, float] = {}
    notes = {"aim": "fair_share_ratio_<case> <= 2"}
    for case in ("disjoint", "colliding"):
        alone, contended, backlog_left = await scenario(settings, colliding=case == "colliding")
        metrics.update({
            f"fair_light_alone_p50_ms_{case}": median(alone),
            f"fair_light_flooded_p50_ms_{case}": median(contended),
            f"fair_light_flooded_p99_ms_{case}": percentile(contended, 0.99),
            f"fair_share_ratio_{case}": median(contended) / median(alone),
        })
        notes[f"light jobs under the flood ({case})"] = str(len(contended))
        notes[f"flood jobs still queued when the light run ended ({case})"] = str(backlog_left)
    report("fairness (light client vs flooding client)", metrics, notes)


if __name__ == "__main__":
    asyncio.run(main())
