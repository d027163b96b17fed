"""A worker frozen past its session timeout (SIGSTOP, a stalled VM) and then resumed is a zombie: its partitions
were given to another worker meanwhile. It may finish what was already running, but it must not start its stale
backlog before it knows it still owns those partitions."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from kiln.schemas.builtin import SleepRequest
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.codec import decode_request
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from tests.streams.harness import read_all

CLASSIC = {"KILN_GROUP_PROTOCOL": "classic"}  # session timeout 10 s (the consumer protocol's broker default is 45 s)


def _assignment(settings: KilnSettings, group: str) -> dict[str, set[int]]:
    """The group's members (by client id: a worker's id) and the partitions each holds."""
    client = admin.admin_client(settings)  # held until the answer is in
    (described,) = client.describe_consumer_groups([group]).values()
    return {str(m.client_id): {tp.partition for tp in m.assignment.topic_partitions}
            for m in described.result(10).members}


def _journal(path: Path) -> list[tuple[str, str, str, float]]:
    return [(e, rid, w, float(at)) for e, rid, w, _attempt, at in (line.split() for line in
                                                                   path.read_text().splitlines())]


async def test_a_resumed_zombie_starts_no_stale_work(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                    tmp_path: Path) -> None:
    request_topic, results = topics(partitions=2)
    group, journal = f"g-{request_topic}", tmp_path / "journal"
    with WorkerProcess("sleep", kafka, request_topic, slots=1, journal=journal, env=CLASSIC) as zombie:
        zombie.wait_assigned()
        async with KilnClient(kafka, f"c-{unique}", results_topic=results, key_spread=8) as client:
            futures = [await client.submit("sleep", SleepRequest(seconds=0.25, tag=f"j{i}"), topic=request_topic)
                       for i in range(160)]
            await _until(lambda: journal.exists() and len(_journal(journal)) >= 4, "the zombie-to-be is not busy")
            with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal, env=CLASSIC) as survivor:
                survivor.wait_assigned()
                zombie_id = _journal(journal)[0][2]  # it was alone, and busy
                await _until(lambda: sorted(map(len, _assignment(kafka, group).values())) == [1, 1],
                             "the second worker did not get a partition")
                held = _assignment(kafka, group)[zombie_id]
                frozen_at = time.time()
                zombie.proc.send_signal(signal.SIGSTOP)
                # Past the 10 s session timeout the group drops the zombie: the survivor owns both partitions.
                await _until(lambda: [len(p) for p in _assignment(kafka, group).values()] == [2],
                             "the group did not give the frozen worker's partition away", timeout_s=60)
                resumed_at = time.time()
                zombie.proc.send_signal(signal.SIGCONT)
                await asyncio.wait_for(asyncio.gather(*futures), 180)
                survivor.terminate()
        zombie.terminate()
    events = _journal(journal)
    starts: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for event, rid, worker, at in events:
        if event == "start":
            starts[rid].append((worker, at))
    assert len(starts) == 160
    # The zombie held stale work: at the freeze its partition had jobs it had not started, which the survivor then
    # ran. (Without such a backlog the check below would hold whatever the zombie did.)
    partition_of = {decode_request(m.value()).request_id: m.partition() for m in read_all(kafka, request_topic)}
    backlog = {rid for rid, runs in starts.items() if partition_of[rid] in held
               and not any(at < frozen_at for _, at in runs)}
    assert len(held) == 1 and len(backlog) >= 10, (held, len(backlog))
    assert all(any(w != zombie_id for w, _ in starts[rid]) for rid in backlog)  # the survivor took it over
    # Jobs the zombie started after it resumed that another worker also ran: stale work started.
    stale = {rid: runs for rid, runs in starts.items()
             if any(w == zombie_id and at >= resumed_at for w, at in runs) and any(w != zombie_id for w, _ in runs)}
    assert stale == {}


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)
