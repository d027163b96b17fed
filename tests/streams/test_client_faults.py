"""The client fails loudly and frees what it took: a refused request raises and holds no slot; a results topic
re-created under it is detected, reported and read from its start (delivery stays once per request id); a future
whose result cannot arrive fails with a typed error after a bound. Against the real broker."""

from __future__ import annotations

import asyncio
import time

import pytest

from kiln.schemas.builtin import EchoRequest
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.errors import InfraError, RequestRefused, ResultLost
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.builtin import echo
from tests.streams.harness import running_worker


async def test_a_refused_request_raises_and_frees_its_slot(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1)
    async with running_worker(echo.stage, kafka, request_topic, slots=2), \
            KilnClient(kafka, f"c-{unique}", results_topic=results, max_in_flight=2) as client:
        for _ in range(3):  # more refusals than slots: each must give its slot back
            with pytest.raises(RequestRefused, match="too large"):
                await client.submit("echo", EchoRequest(data="x"), topic=request_topic, key="k" * 2_000_000)
        assert client.in_flight == 0
        futures = [await asyncio.wait_for(client.submit("echo", EchoRequest(data=i), topic=request_topic), 30)
                   for i in range(2)]
        await asyncio.wait_for(client.settled(), 60)
        assert [client.result_of(f.result()).data for f in futures] == [0, 1]


async def test_a_future_whose_result_cannot_arrive_fails_after_its_bound(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                         unique: str) -> None:
    request_topic, results = topics(partitions=1)  # no worker serves it
    async with KilnClient(kafka, f"c-{unique}", results_topic=results, result_timeout_s=1.0) as client:
        future = await client.submit("echo", EchoRequest(data="x"), topic=request_topic)
        with pytest.raises(ResultLost):
            await asyncio.wait_for(future, 60)
        assert client.in_flight == 0


def _create_again(settings: KilnSettings, topic: str, partitions: int) -> None:
    """Create ``topic`` again after its deletion (the broker needs a moment before the name is free)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if admin.create_topics(settings, [TopicSpec(topic, partitions)]).get(topic) == "created":
                return
        except InfraError:
            pass  # still marked for deletion
        assert time.monotonic() < deadline, f"{topic} could not be created again"
        time.sleep(0.2)


async def test_a_recreated_results_topic_is_read_from_its_start(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    """Results delivered before the topic went, results of requests pending while it was gone: each delivered
    exactly once, and the client says what happened."""
    request_topic, results = topics(partitions=1)
    resets: list[str] = []
    async with running_worker(echo.stage, kafka, request_topic, slots=2) as worker, \
            KilnClient(kafka, f"c-{unique}", results_topic=results, on_results_reset=resets.append) as client:
        before = [await asyncio.wait_for(client.call("echo", EchoRequest(data=i), topic=request_topic), 60)
                  for i in range(5)]
        assert [b.data for b in before] == list(range(5))
        delivered: list[str] = []
        assert not await asyncio.to_thread(admin.delete_topics, kafka, [results])
        pending = [await client.submit("echo", EchoRequest(data=f"p{i}"), topic=request_topic) for i in range(5)]
        for fut in pending:
            fut.add_done_callback(lambda f: delivered.append(f.result().request_id))
        await asyncio.to_thread(_create_again, kafka, results, 2)
        after = [client.result_of(await asyncio.wait_for(fut, 120)).data for fut in pending]
        assert after == [f"p{i}" for i in range(5)]
        more = await asyncio.wait_for(client.call("echo", EchoRequest(data="more"), topic=request_topic), 60)
        assert more.data == "more" and worker.failure is None
    assert resets and len(delivered) == len(set(delivered)) == 5
