"""Slot utilisation with a permanent backlog: how much of the workers' capacity does useful work?

Runs the same workload twice, side by side: consumer-group mode, then queue mode (share group).
Parameters: two ``sleep`` workers with 2 and 6 slots, 16 partitions, job durations
log-normal with median 20 ms and sigma 1 (mean ~33 ms). The client keeps the topic ahead of capacity for the
whole run, so a backlog exists throughout. ``busy_slot_fraction`` (group) and ``busy_slot_fraction_queue`` =
sum of job run times (worker-side started_at..finished_at) inside the measurement window / (8 slots x window).
Aims: group >= 0.95 (0.98 stretch); queue >= 0.98.
Usage: python bench/utilization.py [--seconds 25] [--mode both|group|queue]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from datetime import UTC, datetime

from bench.common import broker, fresh_topics, report
from kiln.schemas.builtin import SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess

SLOTS = (2, 6)
MEDIAN_S, SIGMA = 0.020, 1.0


async def measure(mode: str, seconds: float, warmup: float = 5.0) -> tuple[float, int]:
    settings = broker()
    topic, results = fresh_topics(settings, "util", 16)
    extra = ["--mode", mode]
    workers = [WorkerProcess("sleep", settings, topic, slots=n, extra=extra, env={"KILN_JOB_TIMEOUT_S": "4"})
               for n in SLOTS]
    rng = random.Random(1)
    done: list[ResultEnvelope] = []
    try:
        for w in workers:
            w.wait_assigned()
        capacity = sum(SLOTS) / (MEDIAN_S * math.exp(SIGMA**2 / 2))
        client_settings = settings.model_copy(update={"queue_topics": [topic] if mode == "queue" else []})
        async with KilnClient(client_settings, results_topic=results, max_in_flight=100_000,
                              key_spread=64) as client:
            futures: list[asyncio.Future[ResultEnvelope]] = []
            start = time.monotonic()
            # Keep twice the capacity queued at all times: the backlog never runs dry.
            while (elapsed := time.monotonic() - start) < warmup + seconds:
                while len(futures) < (elapsed + 2) * capacity * 2:
                    secs = min(5.0, rng.lognormvariate(math.log(MEDIAN_S), SIGMA))
                    futures.append(await client.submit("sleep", SleepRequest(seconds=secs), topic=topic))
                await asyncio.sleep(0.05)
            window_start = datetime.fromtimestamp(datetime.now(UTC).timestamp() - seconds, UTC)
            window_end = datetime.now(UTC)
            done = [f.result() for f in futures if f.done() and not f.cancelled()]
    finally:
        for w in workers:
            w.stop()
    busy = 0.0
    for env in done:
        if env.started_at is None:
            continue
        lo, hi = max(env.started_at, window_start), min(env.finished_at, window_end)
        busy += max(0.0, (hi - lo).total_seconds())
    return busy / (sum(SLOTS) * seconds), len(done)


async def main(seconds: float, modes: list[str]) -> None:
    metrics: dict[str, float] = {}
    notes: dict[str, str] = {}
    for mode in modes:
        fraction, jobs = await measure(mode, seconds)
        name = "busy_slot_fraction" if mode == "group" else "busy_slot_fraction_queue"
        metrics[name] = fraction
        notes[f"{mode}: jobs finished"] = str(jobs)
    notes["aim"] = "group >= 0.95 (0.98 stretch), queue >= 0.98"
    report("slot utilisation (2 + 6 slots, 16 partitions, log-normal 20 ms)", metrics, notes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--mode", choices=["both", "group", "queue"], default="both")
    args = parser.parse_args()
    asyncio.run(main(args.seconds, ["group", "queue"] if args.mode == "both" else [args.mode]))
