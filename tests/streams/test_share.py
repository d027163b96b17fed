"""Queue mode (Kafka share groups) on the real broker: idle slots take queued work, crashes redeliver, poison
is dead-lettered, long jobs and brokers without share groups are refused with a clear reason."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from kiln.schemas.builtin import SleepRequest
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.codec import decode_request
from kiln.streams.errors import ConfigError, RequestFailed
from kiln.streams.infra import run_script
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.streams.share import ShareWorker
from kiln.workers.builtin import sleep
from tests.streams.harness import journal_events, read_all

QUEUE = ["--mode", "queue", "--verbose"]


def _group_config(settings: KilnSettings, group: str, **configs: str) -> None:
    entries = [ConfigEntry(k.replace("_", "."), v, incremental_operation=AlterConfigOpType.SET)
               for k, v in configs.items()]
    client = admin.admin_client(settings)  # keep a reference: the futures need the live handle
    for fut in client.incremental_alter_configs(
            [ConfigResource(ResourceType.GROUP, group, incremental_configs=entries)]).values():
        fut.result(15)


def _queue(settings: KilnSettings, topic: str) -> KilnSettings:
    """Client settings for a queue-mode topic (one request per producer batch)."""
    return settings.model_copy(update={"queue_topics": [topic]})


def _concurrency(journal: Path) -> int:
    """Peak number of jobs running at once across all workers, from the journal's timestamps."""
    events = []
    for line in journal.read_text().splitlines():
        ev, *_rest, ts = line.split()
        events.append((float(ts), 1 if ev == "start" else -1))
    peak = now = 0
    for _, delta in sorted(events):
        now += delta
        peak = max(peak, now)
    return peak


def test_long_jobs_are_refused_with_the_reason(kafka: KilnSettings, unique: str) -> None:
    with pytest.raises(ConfigError, match="record lock"):
        ShareWorker(sleep.stage, kafka, slots=1, group_id=f"q-{unique}").check()  # sleep allows 300 s per attempt
    short = dataclasses.replace(sleep.stage, job_timeout_s=4.0)
    ShareWorker(short, kafka, slots=1, group_id=f"q-{unique}").check()


def test_broker_without_share_groups_is_refused(kafka: KilnSettings, tmp_path: Path) -> None:
    env = {"KILN_KAFKA_PORT": "19392", "KILN_KAFKA_SHARE_GROUPS": "0", "KILN_KAFKA_DATA": str(tmp_path / "k"),
           "KILN_KAFKA_HEAP": "256m"}
    import os

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run_script("kafka/kafka.sh", "start")
        plain = kafka.model_copy(update={"bootstrap_servers": "127.0.0.1:19392"})
        short = dataclasses.replace(sleep.stage, job_timeout_s=4.0)
        with pytest.raises(ConfigError, match="no share groups"):
            ShareWorker(short, plain, slots=1).check()
    finally:
        run_script("kafka/kafka.sh", "stop")
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def test_idle_slots_take_queued_jobs_from_any_partition(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                              tmp_path: Path) -> None:
    request_topic, results = topics(partitions=2)
    journal = tmp_path / "journal"
    env = {"KILN_JOB_TIMEOUT_S": "4", "KILN_QUEUE_TOPICS": json.dumps([request_topic])}
    async with KilnClient(_queue(kafka, request_topic), f"c-{unique}", results_topic=results) as client:
        with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal, extra=QUEUE, env=env) as small, \
                WorkerProcess("sleep", kafka, request_topic, slots=6, journal=journal, extra=QUEUE, env=env) as big:
            small.wait_assigned()
            big.wait_assigned()
            await asyncio.sleep(3)  # let all 8 share consumers join the group
            # A consumer group would give each worker one partition: the 6-slot one would idle at 1/3 load.
            futures = [await client.submit("sleep", SleepRequest(seconds=0.3, tag=f"j{i}"), topic=request_topic,
                                           key=f"k{i}") for i in range(128)]
            envelopes = await asyncio.wait_for(asyncio.gather(*futures), 90)
            small.terminate()
            big.terminate()
    assert len({e.request_id for e in envelopes}) == 128
    starts = [(rid, w) for ev, rid, w in journal_events(journal) if ev == "start"]
    per_worker = Counter(w for _, w in starts)
    assert len(per_worker) == 2, "one worker stayed idle"
    counts = sorted(per_worker.values())
    assert counts[1] > counts[0], f"work not shared by slot count: {per_worker}"
    # Any partition: each worker ran jobs of both partitions (a consumer group would give each worker one).
    partition_of = {decode_request(m.value()).request_id: m.partition() for m in read_all(kafka, request_topic)}
    partitions = {w: {partition_of[rid] for rid, x in starts if x == w} for w in per_worker}
    assert all(seen == {0, 1} for seen in partitions.values()), partitions
    assert _concurrency(journal) >= 7, "the 8 slots were not busy together"


async def test_sigkilled_worker_jobs_are_redelivered_after_the_lock(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                    unique: str, tmp_path: Path) -> None:
    request_topic, results = topics(partitions=1)
    journal = tmp_path / "journal"
    group = f"g-{request_topic}"
    _group_config(kafka, group, share_record_lock_duration_ms="12000")
    env = {"KILN_JOB_TIMEOUT_S": "1.5", "KILN_QUEUE_TOPICS": json.dumps([request_topic])}
    async with KilnClient(_queue(kafka, request_topic), f"c-{unique}", results_topic=results) as client:
        futures = [await client.submit("sleep", SleepRequest(seconds=1.0, tag=f"j{i}"), topic=request_topic)
                   for i in range(2)]
        with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal, extra=QUEUE, env=env) as first:
            deadline = time.monotonic() + 30
            while sum(e[0] == "start" for e in journal_events(journal)) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            first.kill()
        killed_at = time.monotonic()
        before = journal_events(journal)
        in_flight = {r for ev, r, _ in before if ev == "start"} - {r for ev, r, _ in before if ev == "end"}
        with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal, extra=QUEUE, env=env) as second:
            envelopes = await asyncio.wait_for(asyncio.gather(*futures), 60)
            waited = time.monotonic() - killed_at
            second.terminate()
    rerun = {rid for ev, rid, _ in journal_events(journal)[len(before):] if ev == "start"}
    assert in_flight and rerun == in_flight, journal.read_text()  # exactly the jobs the dead worker held ran again
    assert len({e.request_id for e in envelopes}) == 2
    # The broker releases a dead member's records when its connection drops (a SIGKILLed process's sockets close
    # at once); the record lock (12 s here) is the bound when a node vanishes without closing them.
    assert waited < 12 + 20
    assert len(read_all(kafka, results, expect=2)) == 2  # one result each: nothing finished twice


async def test_poison_job_is_dead_lettered_at_the_delivery_limit(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                 unique: str) -> None:
    request_topic, results = topics(partitions=1)
    _group_config(kafka, f"g-{request_topic}", share_record_lock_duration_ms="10000")
    env = {"KILN_JOB_TIMEOUT_S": "0.5", "KILN_QUEUE_TOPICS": json.dumps([request_topic])}
    crashes = 0
    async with KilnClient(_queue(kafka, request_topic), f"c-{unique}", results_topic=results) as client:
        poison = await client.submit("sleep", SleepRequest(fail="crash", tag="poison"), topic=request_topic)
        # Each run SIGKILLs its worker; at delivery 5 (half the broker's limit of 10) it is dead-lettered.
        while True:
            worker = WorkerProcess("sleep", kafka, request_topic, slots=1, extra=QUEUE, env=env)
            try:
                await asyncio.to_thread(worker.proc.wait, 15)
                crashes += 1
                assert crashes < 10, "the poison job was never dead-lettered"
            except subprocess.TimeoutExpired:
                break  # this worker survived: it refused the job
        with worker:
            with pytest.raises(RequestFailed, match="DeliveryLimitExceeded"):
                client.result_of(await asyncio.wait_for(poison, 90))
            healthy = await client.call("sleep", SleepRequest(tag="after"), topic=request_topic)
            worker.terminate()
    assert healthy.tag == "after"
    # At most 4 runs. A crash can spend two deliveries: the record released by the dying consumer is acquired at
    # once for its sibling's pending fetch, in the same dead process.
    assert 1 <= crashes <= 4
    dlq = read_all(kafka, f"{request_topic}.dlq", expect=1)
    assert len(dlq) == 1
    headers = dict(dlq[0].headers())
    assert headers["kiln-error-type"] == b"DeliveryLimitExceeded"
    assert 5 <= int(headers["kiln-attempts"]) < 10  # refused before the broker would archive it silently
