"""Lanes: a lane's jobs hold at most its slot budget, and jobs behind them in the same partition start in the slots
left free, so short jobs are not stuck behind a flood of long ones."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kiln.schemas.builtin import SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import sleep
from tests.streams.harness import running_worker


def _max_overlap(results: list[ResultEnvelope]) -> int:
    events = sorted([(r.started_at.timestamp(), 1) for r in results if r.started_at]
                    + [(r.finished_at.timestamp(), -1) for r in results], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


async def test_a_lane_holds_at_most_its_budget(ops_topics: Callable[..., KilnSettings]) -> None:
    settings = ops_topics(("sleep.lanes", 1))
    async with running_worker(sleep.stage, settings, "sleep.lanes", slots=4, lanes={"long": 2}), \
            KilnClient(settings) as client:
        long_jobs = [await client.submit("sleep", SleepRequest(seconds=1.5), topic="sleep.lanes", lane="long")
                     for _ in range(6)]
        await asyncio.sleep(0.3)  # the long jobs are in the partition first
        short = [await client.submit("sleep", SleepRequest(seconds=0.01), topic="sleep.lanes") for _ in range(8)]
        short_results = await asyncio.gather(*short)
        long_results = await asyncio.gather(*long_jobs)
    assert all(r.status == "ok" for r in long_results)
    assert _max_overlap(long_results) == 2  # never more than the budget, and the budget is used
    # The short jobs did not wait behind long ones: each started before the first long job ended (the two slots
    # outside the long lane were free for them).
    first_long_end = min(r.finished_at for r in long_results)
    assert all(r.started_at is not None and r.started_at < first_long_end for r in short_results)
