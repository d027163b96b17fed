"""Fairness: does a flooding client slow down light ones, and does fairness cost the flood anything?

Parameters: one ``sleep`` worker, 8 slots, its default cap per partition (its slots: fairness comes from queueing per
client, not from capping partitions), 16 partitions. Three light
clients each offer one 20 ms job every 100 ms, open loop (whatever their earlier jobs do): 6 s alone (the flood
idle), then from the moment the flooding client has dumped its jobs at once until the flood is served, so every
light job measured under the flood was sent while flood jobs were queued. Each case runs on fresh topics:
- ``disjoint``: 4,000 20 ms flood jobs over 4 client-salted keys; no light client's partition is one of the flood's;
- ``colliding``: the same flood; every light client's partition is one of the flood's (in the log, their jobs sit
  behind the flood's);
- ``keyed``: 4,000 20 ms flood jobs over 256 keys (all 16 partitions: every light client collides);
- ``long``: 400 200 ms flood jobs over 4 keys, the light clients colliding (slot time, not job count, is shared;
  a slot is not taken from a running job, so a light job waits for the next one to free);
- ``long_lane``: the same, the flood's jobs in lane ``long`` with a budget of 7 of the 8 slots (``KILN_LANES``): one
  slot stays free for short jobs, at the cost of an eighth of the flood's throughput.
Metrics per case: ``fair_share_ratio_<case>`` = the light clients' median latency with the flood / alone (aim
<= 2); ``fair_flood_throughput_ratio_<case>`` = the flood's jobs/s beside the light clients / alone (the flood
measured by itself first, same topics and worker; aim >= 0.9).
Usage: python bench/fairness.py [--cases disjoint,colliding,keyed,long] [--scale 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from bench.common import broker, fresh_topics, median, percentile, report
from kiln.schemas.builtin import SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings

PARTITIONS, LIGHT_CLIENTS = 16, 3


@dataclass(frozen=True)
class Case:
    flood_jobs: int
    flood_seconds: float
    flood_keys: int
    light_colliding: bool
    flood_lane: str | None = None


CASES = {
    "disjoint": Case(4000, 0.02, 4, False),
    "colliding": Case(4000, 0.02, 4, True),
    "keyed": Case(4000, 0.02, 256, True),
    "long": Case(400, 0.2, 4, True),
    "long_lane": Case(400, 0.2, 4, True, "long"),
}


def partitions_of(client_id: str, spread: int) -> set[int]:
    """The partitions librdkafka's default partitioner (CRC32 of the key) sends a client's keys to."""
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


async def flood_run(flood: KilnClient, topic: str, case: Case,
                    jobs: int) -> tuple[list[asyncio.Future[ResultEnvelope]], float]:
    """Dump the flood's jobs; returns their futures and when the dump began."""
    started = time.monotonic()
    futures = [await flood.submit("sleep", SleepRequest(seconds=case.flood_seconds), topic=topic,
                                  lane=case.flood_lane) for _ in range(jobs)]
    return futures, started


async def scenario(settings: KilnSettings, case: Case, scale: float) -> dict[str, float]:
    topic, results = fresh_topics(settings, "fair", PARTITIONS)
    flood_id = f"flood-{uuid.uuid4().hex[:6]}"
    flood_parts = partitions_of(flood_id, case.flood_keys)
    light_ids: list[str] = []
    while len(light_ids) < LIGHT_CLIENTS:
        candidate = f"light-{uuid.uuid4().hex[:6]}"
        if partitions_of(candidate, 1).isdisjoint(flood_parts) != case.light_colliding:
            light_ids.append(candidate)
    jobs = max(40, int(case.flood_jobs * scale))
    lanes = {"KILN_LANES": f'{{"{case.flood_lane}": 7}}'} if case.flood_lane else {}
    worker = WorkerProcess("sleep", settings, topic, slots=8, env=lanes)
    try:
        worker.wait_assigned()
        async with KilnClient(settings, flood_id, results_topic=results, key_spread=case.flood_keys,
                              max_in_flight=100_000) as flood:
            lights = [KilnClient(settings, cid, results_topic=results, key_spread=1) for cid in light_ids]
            for light in lights:
                await light.__aenter__()
            try:
                alone = [ms for per in await asyncio.gather(
                    *[light_run(light, topic, lambda: False, 6.0) for light in lights]) for ms in per]
                futures, t0 = await flood_run(flood, topic, case, jobs)
                await asyncio.gather(*futures)
                flood_alone = jobs / (time.monotonic() - t0)
                futures, t0 = await flood_run(flood, topic, case, jobs)
                flood_done: list[float] = []

                async def drain() -> None:
                    await asyncio.gather(*futures)
                    flood_done.append(time.monotonic())

                drained = asyncio.create_task(drain())
                contended = [ms for per in await asyncio.gather(
                    *[light_run(light, topic, lambda: bool(flood_done), 120.0) for light in lights]) for ms in per]
                await drained
                flood_beside = jobs / (flood_done[0] - t0)
            finally:
                for light in lights:
                    await light.__aexit__(None, None, None)
    finally:
        worker.stop()
    return {"alone_p50": median(alone), "flooded_p50": median(contended),
            "flooded_p99": percentile(contended, 0.99), "share": median(contended) / median(alone),
            "flood_ratio": flood_beside / flood_alone, "flood_alone_per_s": flood_alone,
            "light_jobs": float(len(contended))}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--scale", type=float, default=1.0, help="flood sizes times this (a shorter run)")
    args = parser.parse_args()
    settings = broker()
    metrics: dict[str, float] = {}
    notes = {"aim": "fair_share_ratio_<case> <= 2, fair_flood_throughput_ratio_<case> >= 0.9"}
    names = args.cases.split(",")
    if unknown := set(names) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}")
    for name in names:
        figures = await scenario(settings, CASES[name], args.scale)
        metrics.update({
            f"fair_light_alone_p50_ms_{name}": figures["alone_p50"],
            f"fair_light_flooded_p50_ms_{name}": figures["flooded_p50"],
            f"fair_light_flooded_p99_ms_{name}": figures["flooded_p99"],
            f"fair_share_ratio_{name}": figures["share"],
            f"fair_flood_alone_jobs_per_s_{name}": figures["flood_alone_per_s"],
            f"fair_flood_throughput_ratio_{name}": figures["flood_ratio"],
        })
        notes[f"light jobs under the flood ({name})"] = str(int(figures["light_jobs"]))
    report("fairness (light clients vs a flooding client)", metrics, notes)


if __name__ == "__main__":
    asyncio.run(main())
