"""Commits are checked and never stale: a failed commit is counted and re-sent, a commit for a partition this
worker no longer owns is never sent, and the health endpoint never trips over the loop's state."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
from confluent_kafka import Consumer, TopicPartition

from kiln.schemas.builtin import EchoRequest
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import echo
from tests.streams.harness import running_worker


def _committed(settings: KilnSettings, group: str, topic: str, partition: int = 0) -> int:
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": group})
    try:
        return consumer.committed([TopicPartition(topic, partition)], timeout=10)[0].offset
    finally:
        consumer.close()


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def test_a_commit_for_a_partition_no_longer_owned_is_never_sent(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                      unique: str) -> None:
    request_topic, results = topics(partitions=2)
    group = f"g-{request_topic}"
    async with running_worker(echo.stage, kafka, request_topic, slots=2) as worker, \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        futures = [await client.submit("echo", EchoRequest(data=i), topic=request_topic, partition=i % 2)
                   for i in range(6)]
        await asyncio.gather(*futures)
        await _until(lambda: [_committed(kafka, group, request_topic, p) for p in (0, 1)] == [3, 3],
                     "the first worker did not commit its jobs")
        assert {p for _, p in worker._owned} == {0, 1}
        # A second member joins: the group takes one partition from the first worker through its real revoke
        # callback (cooperative rebalance), and gives it to the second.
        async with running_worker(echo.stage, kafka, request_topic, slots=2) as second:
            await _until(lambda: len(worker._owned) == 1 and len(second._owned) == 1,
                         "the rebalance did not split the partitions")
            ((_, lost),) = second._owned
            assert (request_topic, lost) not in worker._owned
            # A commit queued in the first worker before the revoke (here: an older position) that runs after it,
            # as an async commit queued before a revoke would: it must be dropped, not move the offset backwards.
            done = threading.Event()
            worker._commands.put(lambda c: worker._commit_owned(c, [TopicPartition(request_topic, lost, 1)], False))
            worker._commands.put(lambda c: done.set())
            assert await asyncio.to_thread(done.wait, 10)
            assert _committed(kafka, group, request_topic, lost) == 3  # before the second worker commits again
    assert [_committed(kafka, group, request_topic, p) for p in (0, 1)] == [3, 3]


async def test_failed_commits_are_counted_and_the_worker_lives(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1)
    async with running_worker(echo.stage, kafka, request_topic, slots=2) as worker, \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        # The broker refuses a commit for a partition that does not exist (as it refuses a fenced member's).
        bogus = (request_topic, 99)
        worker._commands.put(lambda c: worker._owned.add(bogus))
        worker._commands.put(lambda c: worker._commit_owned(c, [TopicPartition(*bogus, 1)], True))
        async with httpx.AsyncClient() as http:
            for _ in range(100):
                text = (await http.get(f"http://127.0.0.1:{worker.metrics_port}/metrics")).text
                if "kiln_commit_failures_total" in text and "kiln_commit_failures_total{" in text:
                    break
                await asyncio.sleep(0.1)
            health = (await http.get(f"http://127.0.0.1:{worker.metrics_port}/healthz")).json()
        failures = [line for line in text.splitlines() if line.startswith("kiln_commit_failures_total{")]
        assert failures and float(failures[0].rsplit(" ", 1)[1]) >= 1
        assert health["status"] == "ok"
        assert (await client.call("echo", EchoRequest(data="alive"), topic=request_topic)).data == "alive"
