"""Lost workers, preemption, rebalances and client restarts, with real worker processes on a real broker."""

from __future__ import annotations

import asyncio
import os
import time
import zlib
from collections import Counter
from pathlib import Path

from confluent_kafka import Producer

from kiln.schemas.builtin import EchoRequest, SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.offsets import decode_done
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import echo
from tests.streams.harness import committed_position, journal_events, read_all, running_worker


async def _await_until(predicate, limit_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _finished_ahead(settings: KilnSettings, group: str, topic: str) -> int:
    """How many finished-ahead jobs the group's committed position on partition 0 records (commit metadata)."""
    tp = committed_position(settings, group, topic)
    return len(decode_done(tp.offset, tp.metadata)) if tp.offset >= 0 else 0


async def test_sigkill_replays_only_jobs_in_flight(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                   tmp_path: Path) -> None:
    request_topic, results = topics(partitions=1)
    journal = tmp_path / "journal"
    async with KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        with WorkerProcess("sleep", kafka, request_topic, slots=4, journal=journal) as first:
            first.wait_assigned()
            slow_a = await client.submit("sleep", SleepRequest(seconds=4, tag="A"), topic=request_topic)
            fast = [await client.submit("sleep", SleepRequest(seconds=0.05, tag=f"f{i}"), topic=request_topic)
                    for i in range(6)]
            slow_rest = [await client.submit("sleep", SleepRequest(seconds=4, tag=t), topic=request_topic)
                         for t in "BCD"]
            await asyncio.wait_for(asyncio.gather(*fast), 20)
            await _await_until(lambda: sum(e[0] == "start" for e in journal_events(journal)) == 10, 20,
                               "all slow jobs to start")
            # Until the commit carrying the finished-ahead map (the six fast jobs past A) has reached the broker.
            await _await_until(lambda: _finished_ahead(kafka, f"g-{request_topic}", request_topic) == 6, 20,
                               "the finished-ahead map to be committed")
            before = journal_events(journal)
            in_flight = {rid for ev, rid, _ in before if ev == "start"} - {rid for ev, rid, _ in before if ev == "end"}
            first.kill()
        assert len(in_flight) == 4  # A (offset 0, holding the committed offset back), B, C, D

        with WorkerProcess("sleep", kafka, request_topic, slots=4, journal=journal) as second:
            envelopes = await asyncio.wait_for(asyncio.gather(slow_a, *slow_rest), 40)
            second.terminate()
    after = journal_events(journal)[len(before):]
    rerun = {rid for ev, rid, _ in after if ev == "start"}
    assert rerun == in_flight, "jobs finished before the crash were run again, or in-flight ones were lost"
    assert {e.request_id for e in envelopes} == in_flight
    # Every request has exactly one result on the wire: nothing finished was redone.
    raw = read_all(kafka, results, expect=10)
    assert len(raw) == 10


async def test_sigterm_finishes_running_jobs_and_leaves_the_rest(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                                 tmp_path: Path) -> None:
    request_topic, results = topics(partitions=1)
    journal = tmp_path / "journal"
    async with KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal, grace_s=10) as first:
            first.wait_assigned()
            futures = [await client.submit("sleep", SleepRequest(seconds=1.5, tag=f"j{i}"), topic=request_topic)
                       for i in range(6)]
            await _await_until(lambda: sum(e[0] == "start" for e in journal_events(journal)) == 2, 20,
                               "two jobs to start")
            rc = await asyncio.to_thread(first.terminate, 30)
        assert rc == 0
        first_run = journal_events(journal)
        # The two running jobs finished, and nothing else started (the rest was left for the next worker).
        assert Counter(ev for ev, _, _ in first_run) == {"start": 2, "end": 2}, "running jobs were not finished"
        await _await_until(lambda: sum(f.done() for f in futures) >= 2, 20, "the finished jobs' results")
        assert sum(f.done() for f in futures) == 2

        with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal) as second:
            await asyncio.wait_for(asyncio.gather(*futures), 30)
            second.terminate()
    second_run = journal_events(journal)[len(first_run):]
    assert {rid for ev, rid, _ in second_run if ev == "start"}.isdisjoint({rid for _, rid, _ in first_run})
    assert sum(ev == "start" for ev, _, _ in second_run) == 4


async def test_short_grace_abandons_the_job_which_replays_elsewhere(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                    unique: str, tmp_path: Path) -> None:
    request_topic, results = topics(partitions=1)
    journal = tmp_path / "journal"
    async with KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        with WorkerProcess("sleep", kafka, request_topic, slots=1, journal=journal, grace_s=0.5) as first:
            first.wait_assigned()
            fut = await client.submit("sleep", SleepRequest(seconds=5, tag="long"), topic=request_topic)
            await _await_until(lambda: len(journal_events(journal)) == 1, 20, "the job to start")
            assert await asyncio.to_thread(first.terminate, 30) == 0
        with WorkerProcess("sleep", kafka, request_topic, slots=1, journal=journal) as second:
            envelope = await asyncio.wait_for(fut, 30)
            second.terminate()
    workers = [w for ev, _, w in journal_events(journal) if ev == "start"]
    assert len(workers) == 2 and workers[0] != workers[1] and envelope.worker == workers[1]


async def test_two_workers_rebalance_without_losing_or_repeating(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                                 tmp_path: Path) -> None:
    request_topic, results = topics(partitions=4)
    journal = tmp_path / "journal"
    async with KilnClient(kafka, f"c-{unique}", results_topic=results, key_spread=8) as client:
        with WorkerProcess("sleep", kafka, request_topic, slots=4, journal=journal) as first:
            first.wait_assigned()
            futures = [await client.submit("sleep", SleepRequest(seconds=0.2, tag=f"j{i}"), topic=request_topic)
                       for i in range(30)]
            with WorkerProcess("sleep", kafka, request_topic, slots=4, journal=journal) as second:
                second.wait_assigned()
                futures += [await client.submit("sleep", SleepRequest(seconds=0.2), topic=request_topic)
                            for _ in range(60)]
                envelopes = await asyncio.wait_for(asyncio.gather(*futures), 60)
                second.terminate()
            first.terminate()
    assert len({e.request_id for e in envelopes}) == 90
    starts = Counter(rid for ev, rid, _ in journal_events(journal) if ev == "start")
    assert set(starts) == {e.request_id for e in envelopes}
    assert max(starts.values()) == 1, "a job ran twice across the rebalance"
    assert len({w for ev, _, w in journal_events(journal) if ev == "start"}) == 2, "the second worker got no work"


async def test_restarted_client_gets_results_of_its_previous_life(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                  unique: str) -> None:
    request_topic, results = topics(partitions=2, results_partitions=4)
    client_id = f"trainer-{unique}"
    first_life = KilnClient(kafka, client_id, results_topic=results)
    sent = [(await first_life.submit("echo", EchoRequest(data=i), topic=request_topic)) for i in range(10)]
    ids = {rid for rid in first_life._state.pending}  # type: ignore[union-attr]
    await first_life.close()  # "crash": the futures are gone, results not yet produced
    assert all(f.done() for f in sent)

    async with running_worker(echo.stage, kafka, request_topic, slots=4):
        second_life = KilnClient(kafka, client_id, results_topic=results)
        got = []
        async for envelope in second_life.unclaimed():
            got.append(envelope)
            if len(got) == 10:
                break
        await second_life.close()
    assert {e.request_id for e in got} == ids
    assert sorted(second_life.result_of(e).data for e in got) == list(range(10))

    third_life = KilnClient(kafka, client_id, results_topic=results)
    again: list[object] = []

    # A marker result behind everything on the client's results partition: the third life has read past every
    # earlier result once it yields the marker, so whatever it yields before is a redelivery.
    marker = ResultEnvelope(request_id=f"marker-{unique}", kind="echo", client_id=client_id, status="ok")
    producer = Producer(kafka.kafka())
    producer.produce(results, marker.model_dump_json().encode(), key=client_id,
                     partition=zlib.crc32(client_id.encode()) % 4)  # the client's partition of the 4
    assert producer.flush(30) == 0

    async def drain() -> None:
        async for envelope in third_life.unclaimed():
            if envelope.request_id == marker.request_id:
                return
            again.append(envelope)

    await asyncio.wait_for(drain(), 60)
    await third_life.close()
    assert again == [], "results delivered in a previous life were delivered again"


def test_forked_child_gets_fresh_kafka_handles(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1)
    client = KilnClient(kafka, f"parent-{unique}", results_topic=results)

    async def serve_and_call(n: int) -> list[object]:
        async with running_worker(echo.stage, kafka, request_topic, slots=2):
            return [(await client.call("echo", EchoRequest(data=f"parent-{i}"), topic=request_topic)).data
                    for i in range(n)]

    assert asyncio.run(serve_and_call(1)) == ["parent-0"]  # the parent's handles exist now
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not touch the parent's librdkafka handles
        code = 1
        try:
            async def child() -> str:
                fut = await client.submit("echo", EchoRequest(data="from-child"), topic=request_topic)
                env = await asyncio.wait_for(fut, 30)
                return f"{client.result_of(env).data} {env.client_id}"

            os.write(write_fd, asyncio.run(child()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    # The parent serves the child's request with a worker while the child waits.
    asyncio.run(serve_and_call(1))
    _, status = os.waitpid(pid, 0)
    answer = os.read(read_fd, 1000).decode()
    assert os.waitstatus_to_exitcode(status) == 0, answer
    data, child_id = answer.split()
    assert data == "from-child" and child_id == f"parent-{unique}.{pid}"
