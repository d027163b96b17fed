"""Replay cost after a crash: how many jobs run again per job that was in flight when a worker died?

Parameters: one ``sleep`` worker with 8 slots on 4 partitions; jobs sleep uniformly 0.05-2 s; 400 jobs queued;
the worker is SIGKILLed after --kill-after seconds and a fresh one takes over. From the workers' journals:
in flight = started by the first worker and not finished; re-executed = started by both workers.
``reexecuted_per_inflight`` (aim <= 1.0: only jobs really in flight run again). Repeated --rounds times.
Usage: python bench/replay_cost.py [--rounds 3] [--kill-after 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path

from bench.common import broker, fresh_topics, report
from kiln.schemas.builtin import SleepRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess

JOBS, SLOTS = 400, 8


def _events(path: Path) -> list[tuple[str, str]]:
    return [(line.split()[0], line.split()[1]) for line in path.read_text().splitlines()] if path.exists() else []


async def one_round(seed: int, kill_after: float) -> tuple[int, int, int]:
    settings = broker()
    topic, results = fresh_topics(settings, "replay", 4)
    journal = Path(tempfile.mkdtemp()) / "journal"
    rng = random.Random(seed)
    async with KilnClient(settings, results_topic=results, key_spread=8) as client:
        first = WorkerProcess("sleep", settings, topic, slots=SLOTS, journal=journal)
        first.wait_assigned()
        futures = [await client.submit("sleep", SleepRequest(seconds=rng.uniform(0.05, 2.0)), topic=topic)
                   for _ in range(JOBS)]
        await asyncio.sleep(kill_after)
        first.kill()
        before = _events(journal)
        started = {rid for ev, rid in before if ev == "start"}
        in_flight = started - {rid for ev, rid in before if ev == "end"}
        second = WorkerProcess("sleep", settings, topic, slots=SLOTS, journal=journal)
        try:
            envelopes = await asyncio.wait_for(asyncio.gather(*futures), 300)
        finally:
            second.stop()
    rerun = {rid for ev, rid in _events(journal)[len(before):] if ev == "start"} & started
    assert len({e.request_id for e in envelopes}) == JOBS
    return len(in_flight), len(rerun), len(started) - len(in_flight)


async def main(rounds: int, kill_after: float) -> None:
    totals = [0, 0, 0]
    for r in range(rounds):
        in_flight, rerun, finished = await one_round(r, kill_after)
        totals = [totals[0] + in_flight, totals[1] + rerun, totals[2] + finished]
    report("re-execution after SIGKILL", {
        "replay_inflight_jobs": totals[0],
        "replay_reexecuted_jobs": totals[1],
        "reexecuted_per_inflight": totals[1] / max(1, totals[0]),
    }, {"finished before the kill": str(totals[2]), "rounds": str(rounds), "aim": "<= 1.0"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-after", type=float, default=4.0)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.kill_after))
