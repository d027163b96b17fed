"""Commits are checked and never stale: a failed commit is counted and re-sent, a commit for a partition this
worker no longer owns is never sent, and the health endpoint never trips over the loop's state."""

from __future__ import annotations

import asyncio
import threading

import httpx
from confluent_kafka import Consumer, TopicPartition

from kiln.schemas.builtin import EchoRequest
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import echo
from tests.streams.harness import running_worker


def _committed(settings: KilnSettings, group: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": group})
    try:
        return consumer.committed([TopicPartition(topic, 0)], timeout=10)[0].offset
    finally:
        consumer.close()


async def test_a_commit_for_a_partition_no_longer_owned_is_never_sent(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                      unique: str) -> None:
    request_topic, results = topics(partitions=1)
    async with running_worker(echo.stage, kafka, request_topic, slots=2) as worker, \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        for i in range(3):
            await client.call("echo", EchoRequest(data=i), topic=request_topic)
        await asyncio.sleep(0.5)
        assert _committed(kafka, f"g-{request_topic}", request_topic) == 3
        # A commit queued earlier (here: an older position) that runs after the partition was revoked, as an async
        # commit queued before a revoke would: it must be dropped, not move the group's offset backwards.
        done = threading.Event()
        worker._commands.put(lambda c: worker._owned.discard((request_topic, 0)))  # as the revoke callback does
        worker._commands.put(lambda c: worker._commit_owned(c, [TopicPartition(request_topic, 0, 1)], False))
        worker._commands.put(lambda c: done.set())
        assert await asyncio.to_thread(done.wait, 10)
    assert _committed(kafka, f"g-{request_topic}", request_topic) == 3


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
