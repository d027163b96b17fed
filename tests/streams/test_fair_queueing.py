"""Fair queueing per client and spilled finished-ahead maps, with real worker processes on a real broker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kiln.schemas.builtin import SleepRequest
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.offsets import SPILL_PREFIX, decode_done
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from tests.streams.harness import committed_position, journal_events, read_all


async def test_a_light_client_behind_a_flood_on_its_partition_is_served_next(  # type: ignore[no-untyped-def]
        kafka: KilnSettings, topics, unique: str) -> None:
    """One partition: the light client's jobs sit behind 300 of the flood's in the log. FIFO would run them after
    all 300; per-client fair queueing runs them at once, while most of the flood still waits."""
    request_topic, results = topics(partitions=1)
    with WorkerProcess("sleep", kafka, request_topic, slots=2) as worker:
        worker.wait_assigned()
        async with KilnClient(kafka, f"flood-{unique}", results_topic=results, max_in_flight=1000) as flood, \
                KilnClient(kafka, f"light-{unique}", results_topic=results) as light:
            flooded = [await flood.submit("sleep", SleepRequest(seconds=0.05), topic=request_topic)
                       for _ in range(300)]
            await asyncio.sleep(0.5)  # the flood is in the worker's read-ahead before the light jobs arrive
            answers = await asyncio.wait_for(asyncio.gather(
                *[light.call("sleep", SleepRequest(seconds=0.05), topic=request_topic) for _ in range(5)]), 60)
            flood_done = sum(f.done() for f in flooded)
            await asyncio.wait_for(asyncio.gather(*flooded), 120)
    assert len(answers) == 5
    assert flood_done < 150, f"the light client waited behind {flood_done} of the flood's 300 jobs"


async def test_a_weighted_client_gets_its_weight_in_slot_time(  # type: ignore[no-untyped-def]
        kafka: KilnSettings, topics, unique: str) -> None:
    """``KILN_CLIENT_WEIGHTS``: with one slot and both clients backlogged, weight 3 gets three jobs to the other's
    one (equal weights would finish both together; no weights at all, in arrival order)."""
    request_topic, results = topics(partitions=1)
    weights = {"KILN_CLIENT_WEIGHTS": f'{{"heavy-{unique}": 3}}'}
    with WorkerProcess("sleep", kafka, request_topic, slots=1, env=weights) as worker:
        worker.wait_assigned()
        async with KilnClient(kafka, f"heavy-{unique}", results_topic=results, max_in_flight=1000) as heavy, \
                KilnClient(kafka, f"plain-{unique}", results_topic=results, max_in_flight=1000) as plain:
            jobs = SleepRequest(seconds=0.02)
            plain_jobs, heavy_jobs = [], []
            for _ in range(60):  # interleaved, so arrival order alone would alternate them
                plain_jobs.append(await plain.submit("sleep", jobs, topic=request_topic))
                heavy_jobs.append(await heavy.submit("sleep", jobs, topic=request_topic))
            await asyncio.wait_for(asyncio.gather(*heavy_jobs), 60)
            plain_done = sum(f.done() for f in plain_jobs)
            await asyncio.wait_for(asyncio.gather(*plain_jobs), 60)
    assert 10 <= plain_done <= 35, f"{plain_done} of the plain client's 60 jobs ran beside the weighted client's 60"


async def test_a_map_too_big_for_the_commit_is_spilled_and_read_back(  # type: ignore[no-untyped-def]
        kafka: KilnSettings, topics, unique: str, tmp_path: Path) -> None:
    """Jobs finished ahead of slow ones, in a map longer than the commit may carry (here 16 characters): the commit
    names a blob holding it; after a SIGKILL the next owner reads it and runs only the jobs that were in flight."""
    request_topic, results = topics(partitions=1)
    journal = tmp_path / "journal"
    group = f"g-{request_topic}"
    pattern = "LSSLSLSSSLSSLSLLSSSL"  # slow (in flight at the crash) and short jobs, irregular runs
    env = {"KILN_OFFSET_METADATA_CHARS": "16"}
    async with KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        with WorkerProcess("sleep", kafka, request_topic, slots=len(pattern), journal=journal, env=env) as first:
            first.wait_assigned()
            futures = [await client.submit("sleep", SleepRequest(seconds=6 if kind == "L" else 0.01),
                                           topic=request_topic) for kind in pattern]
            short = [f for f, kind in zip(futures, pattern, strict=True) if kind == "S"]
            await asyncio.wait_for(asyncio.gather(*short), 30)
            store = open_blob_store(kafka.model_copy(update={"blob_store": f"file://{kafka.cache / 'blobs'}"}))
            deadline = time.monotonic() + 20
            while True:  # until the commit carries every short job as finished ahead of the first slow one
                committed = committed_position(kafka, group, request_topic)
                if len(decode_done(committed.offset, committed.metadata, store.get)) == pattern.count("S"):
                    break
                assert time.monotonic() < deadline, "the finished-ahead map was not committed"
                await asyncio.sleep(0.1)
            before = journal_events(journal)
            in_flight = {r for e, r, _ in before if e == "start"} - {r for e, r, _ in before if e == "end"}
            first.kill()
        assert committed.offset == 0 and committed.metadata.startswith(SPILL_PREFIX)
        assert len(in_flight) == pattern.count("L")

        with WorkerProcess("sleep", kafka, request_topic, slots=len(pattern), journal=journal, env=env) as second:
            await asyncio.wait_for(asyncio.gather(*futures), 60)
            second.terminate()
    rerun = {r for e, r, _ in journal_events(journal)[len(before):] if e == "start"}
    assert rerun == in_flight, "finished jobs ran again (the spilled map was not read back) or in-flight ones were lost"
    assert len(read_all(kafka, results, expect=len(pattern))) == len(pattern)
