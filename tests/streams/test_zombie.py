"""A worker frozen past its session timeout (SIGSTOP, a stalled VM) and then resumed is a zombie: its partitions
were given to another worker meanwhile. It may finish what was already running, but it must not start its stale
backlog before it knows it still owns those partitions."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import defaultdict
from pathlib import Path

from kiln.schemas.builtin import SleepRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings

CLASSIC = {"KILN_GROUP_PROTOCOL": "classic"}  # session timeout 10 s (the consumer protocol's broker default is 45 s)


async def test_a_resumed_zombie_starts_no_stale_work(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                    tmp_path: Path) -> None:
    request_topic, results = topics(partitions=2)
    journal = tmp_path / "journal"
    with WorkerProcess("sleep", kafka, request_topic, slots=1, journal=journal, env=CLASSIC) as zombie:
        zombie.wait_assigned()
        async with KilnClient(kafka, f"c-{unique}", results_topic=results, key_spread=8) as client:
            futures = [await client.submit("sleep", SleepRequest(seconds=0.25, tag=f"j{i}"), topic=request_topic)
                       for i in range(160)]
            await asyncio.sleep(2)  # the zombie-to-be is busy, with a backlog of fetched jobs
            with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal, env=CLASSIC) as survivor:
                survivor.wait_assigned()
                zombie.proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(16)  # past the 10 s session timeout: the survivor owns both partitions
                resumed_at = time.time()
                zombie.proc.send_signal(signal.SIGCONT)
                await asyncio.wait_for(asyncio.gather(*futures), 180)
                survivor.terminate()
        zombie.terminate()
    starts: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for line in journal.read_text().splitlines():
        event, rid, worker, _attempt, at = line.split()
        if event == "start":
            starts[rid].append((worker, float(at)))
    assert len(starts) == 160
    zombie_id = min((at, worker) for runs in starts.values() for worker, at in runs)[1]  # it started first
    # Jobs the zombie started after it resumed that another worker also ran: stale work started.
    stale = {rid: runs for rid, runs in starts.items()
             if any(w == zombie_id and at >= resumed_at for w, at in runs) and any(w != zombie_id for w, _ in runs)}
    assert stale == {}
