"""The stats stream against real workers: its numbers equal what the test submitted and what the workers' journals
say they ran, the queue length is known with zero workers, and the numbers reach kiln.stats and /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
from confluent_kafka import Producer

from kiln.schemas.builtin import SleepRequest
from kiln.schemas.ops import StageStats
from kiln.streams.client import KilnClient
from kiln.streams.processes import StatsProcess, WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import STATS_TOPIC
from tests.streams.harness import journal_events, read_all

FAST = {"KILN_HEARTBEAT_S": "1"}


async def _submit(settings: KilnSettings, requests: list[SleepRequest]) -> list[str]:
    """Submits and waits for every result; returns the request ids of the ones that succeeded."""
    async with KilnClient(settings) as client:
        futures = [await client.submit("sleep", r) for r in requests]
        results = await asyncio.gather(*futures)
    return [r.request_id for r in results if r.status == "ok"]


def test_stats_match_the_journals(ops_topics: Callable[..., KilnSettings],
                                  stats_process: Callable[..., StatsProcess], tmp_path: Path) -> None:
    settings = ops_topics(("sleep.requests", 4))
    stats = stats_process(settings)
    journal = tmp_path / "journal"
    env = {"KILN_TOPIC_PREFIX": settings.topic_prefix, **FAST}
    workers = [WorkerProcess("sleep", settings, "sleep.requests", slots=slots, journal=journal, env=env)
               for slots in (2, 3)]
    for w in workers:
        w.wait_assigned()
    stats.wait("sleep", lambda s: s["workers_now"] == 2 and s["slots_now"] == 5)

    requests = ([SleepRequest(seconds=0.1, tag=f"ok{i}") for i in range(12)]
                + [SleepRequest(fail="permanent", tag=f"bad{i}") for i in range(3)]
                + [SleepRequest(fail="transient", fail_attempts=1, tag=f"retry{i}") for i in range(2)])
    ok_ids = asyncio.run(_submit(settings, requests))
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    producer.produce(settings.topic("sleep.requests"), b"not an envelope")
    producer.flush(10)

    ended = [request_id for event, request_id, _ in journal_events(journal) if event == "end"]
    assert sorted(ended) == sorted(ok_ids) and len(ok_ids) == 14
    # Permanent failures are dead-lettered too: 3 + the malformed record.
    dead = read_all(settings, settings.topic("sleep.requests.dlq"), expect=4)
    assert len(dead) == 4
    numbers = stats.wait("sleep", lambda s: s["completions_per_min"] == 17 and s["dead_letters_per_min"] == 4
                         and s["queue_length"] == 0)
    assert numbers["completions_total"] == 17
    assert numbers["failures_per_min"] == {"PermanentJobError": 3}
    assert 0 < numbers["workers_avg"] <= 2 and 0 < numbers["slots_avg"] <= 5

    WorkerProcess.stop_all(workers)
    stats.wait("sleep", lambda s: s["workers_now"] == 0)  # tombstones, not staleness: well inside 3 heartbeats
    asyncio.run(_submit_only(settings, 9))
    numbers = stats.wait("sleep", lambda s: s["queue_length"] == 9)
    assert numbers["workers_now"] == 0

    published = [StageStats.model_validate_json(m.value()) for m in read_all(settings, settings.topic(STATS_TOPIC))
                 if m.key() == b"sleep"]
    assert any(p.queue_length == 9 for p in published) and published[-1].completions_total == 17
    metrics = httpx.get(f"{stats.url}/metrics", timeout=5).text
    assert 'kiln_stats_queue_length{stage="sleep"} 9.0' in metrics
    assert 'kiln_stats_failures_per_min{reason="PermanentJobError",stage="sleep"}' in metrics


async def _submit_only(settings: KilnSettings, n: int) -> None:
    async with KilnClient(settings) as client:
        for i in range(n):
            await client.submit("sleep", SleepRequest(seconds=0.1, tag=f"late{i}"))
