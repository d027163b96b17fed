"""Head-of-line blocking, measured apart from slot saturation; and lanes, the answer to saturation.

One ``sleep`` worker with 8 slots on a 2-partition topic. Fast jobs sleep 5 ms; in mixed runs 1 % of jobs sleep
10 s. Every run offers the same rate: half the worker's capacity under the mixed load (8 slots / mean service time),
for --seconds. Runs (fast jobs always on partition 0):
  fast_only   no slow jobs;
  same        slow jobs on partition 0, with the fast ones;
  separate    slow jobs on partition 1;
  lanes       as ``same``, the slow jobs in lane ``long`` and the worker's budget for it 8 - 2 slots.
``hol_p99_ratio`` = fast p99 same ÷ fast p99 separate: what sharing a partition costs (aim ≤ 1.2); the slots the
slow jobs hold are the same in both. ``slot_saturation_p99_ratio`` = fast p99 same ÷ fast-only (the old figure: at
half capacity the slow jobs hold ~3.8 slots on average, all 8 now and then); ``lanes_p99_ratio`` = fast p99 with
lanes ÷ fast-only.
Usage: python bench/hol.py [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from bench.common import broker, fresh_topics, offer_at_rate, percentile, report
from kiln.schemas.builtin import SleepRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings

SLOTS, FAST_S, SLOW_S, SLOW_SHARE, KEEP_FREE = 8, 0.005, 10.0, 0.01, 2
RUNS = {  # slow share, slow jobs' partition, slow jobs' lane, worker lanes
    "fast_only": (0.0, 0, None, {}),
    "same": (SLOW_SHARE, 0, None, {}),
    "separate": (SLOW_SHARE, 1, None, {}),
    "lanes": (SLOW_SHARE, 0, "long", {"long": SLOTS - KEEP_FREE}),
}


async def run(client: KilnClient, topic: str, rate: float, seconds: float, slow_share: float, slow_partition: int,
              lane: str | None) -> list[float]:
    rng = random.Random(42)
    fast_latencies: list[float] = []

    async def one(_n: int) -> None:
        slow = rng.random() < slow_share
        t0 = time.monotonic()
        request = SleepRequest(seconds=SLOW_S if slow else FAST_S)
        await (await client.submit("sleep", request, topic=topic, partition=slow_partition if slow else 0,
                                   lane=lane if slow else None))
        if not slow:
            fast_latencies.append((time.monotonic() - t0) * 1000)

    await offer_at_rate(rate, seconds, one)
    return fast_latencies


async def one_run(settings: KilnSettings, label: str, rate: float, seconds: float) -> list[float]:
    share, slow_partition, lane, lanes = RUNS[label]
    topic, res = fresh_topics(settings, f"hol-{label}", 2)
    worker = WorkerProcess("sleep", settings, topic, slots=SLOTS, env={"KILN_LANES": json.dumps(lanes)})
    try:
        worker.wait_assigned()
        async with KilnClient(settings, results_topic=res) as client:
            return await run(client, topic, rate, seconds, share, slow_partition, lane)
    finally:
        worker.stop()


async def main(seconds: float) -> None:
    settings = broker()
    capacity = SLOTS / ((1 - SLOW_SHARE) * FAST_S + SLOW_SHARE * SLOW_S)
    rate = capacity / 2
    p99 = {label: percentile(await one_run(settings, label, rate, seconds), 0.99) for label in RUNS}
    report("head-of-line blocking (2 partitions, 8 slots)", {
        "hol_fast_only_p99_ms": p99["fast_only"],
        "hol_same_partition_fast_p99_ms": p99["same"],
        "hol_separate_partition_fast_p99_ms": p99["separate"],
        "hol_lanes_fast_p99_ms": p99["lanes"],
        "hol_p99_ratio": p99["same"] / p99["separate"],
        "slot_saturation_p99_ratio": p99["same"] / p99["fast_only"],
        "lanes_p99_ratio": p99["lanes"] / p99["fast_only"],
    }, {"offered rate (jobs/s)": f"{rate:.1f}", "aim": "hol_p99_ratio <= 1.2",
        "lanes": f"long jobs hold at most {SLOTS - KEEP_FREE} of {SLOTS} slots"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    asyncio.run(main(parser.parse_args().seconds))
