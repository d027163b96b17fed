"""Head-of-line blocking: do slow jobs delay fast ones that share their partition?

Parameters: one ``sleep`` worker with 8 slots on a 1-partition topic (the worst case: everything shares it).
Fast jobs sleep 5 ms; in the mixed run 1 % of jobs sleep 10 s. Offered load is half the worker's capacity in the
mixed run (8 slots / mean service time); the fast-only run offers the same rate. Each run lasts --seconds.
``hol_p99_ratio`` = p99 latency of fast jobs with slow ones mixed in / p99 of the fast-only run (aim <= 1.2).
Usage: python bench/hol.py [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from bench.common import broker, fresh_topics, offer_at_rate, percentile, report
from kiln.schemas.builtin import SleepRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess

SLOTS, FAST_S, SLOW_S, SLOW_SHARE = 8, 0.005, 10.0, 0.01


async def run(client: KilnClient, topic: str, rate: float, seconds: float, slow_share: float) -> list[float]:
    rng = random.Random(42)
    fast_latencies: list[float] = []

    async def one(_n: int) -> None:
        slow = rng.random() < slow_share
        t0 = time.monotonic()
        await (await client.submit("sleep", SleepRequest(seconds=SLOW_S if slow else FAST_S), topic=topic))
        if not slow:
            fast_latencies.append((time.monotonic() - t0) * 1000)

    await offer_at_rate(rate, seconds, one)
    return fast_latencies


async def main(seconds: float) -> None:
    settings = broker()
    capacity = SLOTS / ((1 - SLOW_SHARE) * FAST_S + SLOW_SHARE * SLOW_S)
    rate = capacity / 2
    results: dict[str, list[float]] = {}
    for label, share in (("fast_only", 0.0), ("mixed", SLOW_SHARE)):
        topic, res = fresh_topics(settings, f"hol-{label}", 1)
        worker = WorkerProcess("sleep", settings, topic, slots=SLOTS)
        try:
            worker.wait_assigned()
            async with KilnClient(settings, results_topic=res) as client:
                results[label] = await run(client, topic, rate, seconds, share)
        finally:
            worker.stop()
    p99_alone, p99_mixed = percentile(results["fast_only"], 0.99), percentile(results["mixed"], 0.99)
    report("head-of-line blocking (1 partition, 8 slots)", {
        "hol_fast_only_p99_ms": p99_alone,
        "hol_mixed_fast_p99_ms": p99_mixed,
        "hol_p99_ratio": p99_mixed / p99_alone,
    }, {"offered rate (jobs/s)": f"{rate:.1f}", "aim": "hol_p99_ratio <= 1.2"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    asyncio.run(main(parser.parse_args().seconds))
