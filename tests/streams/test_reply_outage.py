"""A broker outage on the reply path is retried, not a worker exit: the first reply to a topic needs its metadata,
and that lookup meets no broker. On a broker of the test's own (stopped and started again; stopped at the end)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.chaos import broker
from kiln.schemas.builtin import EchoRequest, EchoResult
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import JobContext, Stage, TopicSpec
from kiln.workers.builtin import echo
from tests.streams.harness import read_all, running_worker

PORT = 19292


@pytest.fixture
def own_broker() -> Iterator[KilnSettings]:
    broker(PORT, "start")
    try:
        settings = KilnSettings(bootstrap_servers=f"127.0.0.1:{PORT}")
        admin.wait_for_broker(settings)
        yield settings
    finally:
        broker(PORT, "stop")


async def test_a_reply_lookup_during_an_outage_is_retried(own_broker: KilnSettings, unique: str) -> None:
    settings = own_broker
    request_topic, results = f"req-{unique}", f"res-{unique}"
    names = [request_topic, f"{request_topic}.dlq", results]
    admin.create_topics(settings, [TopicSpec(request_topic, 1), TopicSpec(f"{request_topic}.dlq", 1),
                                   TopicSpec(results, 2)])
    started, gate = asyncio.Event(), asyncio.Event()

    async def held(request: EchoRequest, ctx: JobContext) -> EchoResult:
        del ctx
        started.set()
        await gate.wait()
        return EchoResult(data=request.data)

    try:
        async with running_worker(Stage(echo.stage.spec, held), settings, request_topic, slots=1) as worker, \
                KilnClient(settings, f"c-{unique}", results_topic=results) as client:
            future = await client.submit("echo", EchoRequest(data="through"), topic=request_topic)
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.to_thread(broker, PORT, "stop")
            gate.set()  # the job ends while no broker answers: its reply's metadata lookup cannot

            def retries() -> float:
                return worker.metrics.registry.get_sample_value(
                    "kiln_delivery_retries_total", {"stage": "echo", "worker": worker.worker_id, "what": "reply"}) or 0

            while retries() < 1:
                assert worker.failure is None, worker.failure
                await asyncio.sleep(0.2)
            await asyncio.to_thread(broker, PORT, "start")
            result = await asyncio.wait_for(future, 180)
            assert client.result_of(result).data == "through"
            assert worker.failure is None and worker.health()["status"] == "ok"
        assert await asyncio.to_thread(read_all, settings, f"{request_topic}.dlq", 0, 5) == []
    finally:
        admin.delete_topics(settings, names)
