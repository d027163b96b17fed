"""The client fails loudly and frees what it took: a refused request raises and holds no slot; a results topic
re-created under it is detected, reported and read from its start (delivery stays once per request id); a future
whose result cannot arrive fails with a typed error after a bound; a broker away at its first use is a typed error
to ``submit()`` and waited for by ``unclaimed()``. Against the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib

import pytest
from confluent_kafka import Producer

from bench.chaos import create_again, delete_until_gone
from kiln.schemas.builtin import EchoRequest
from kiln.schemas.envelope import ResultEnvelope, new_request_id
from kiln.streams import codec
from kiln.streams.client import KilnClient
from kiln.streams.errors import BrokerUnavailable, RequestRefused, ResultLost
from kiln.streams.processes import free_port
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
        await asyncio.to_thread(delete_until_gone, kafka, results)  # then its pending results cannot land in it
        pending = [await client.submit("echo", EchoRequest(data=f"p{i}"), topic=request_topic) for i in range(5)]
        for fut in pending:
            fut.add_done_callback(lambda f: delivered.append(f.result().request_id))
        await asyncio.to_thread(create_again, kafka, TopicSpec(results, 2))
        after = [client.result_of(await asyncio.wait_for(fut, 120)).data for fut in pending]
        assert after == [f"p{i}" for i in range(5)]
        more = await asyncio.wait_for(client.call("echo", EchoRequest(data="more"), topic=request_topic), 60)
        assert more.data == "more" and worker.failure is None
    assert resets and len(delivered) == len(set(delivered)) == 5


async def test_a_request_the_broker_never_took_fails_when_the_client_closes(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                            unique: str) -> None:
    """A request still in the producer's queue when the client closes (here one to a topic that is not there, which
    librdkafka holds while it waits for the topic to appear) fails with ``RequestRefused``: it is not left cancelled
    as if its result would reach the client's next life, which can never receive it."""
    _request_topic, results = topics(partitions=1)
    client = KilnClient(kafka, f"c-{unique}", results_topic=results)
    future = await client.submit("echo", EchoRequest(data="x"), topic=f"absent-{unique}")
    await client.close()
    with pytest.raises(RequestRefused, match="was not sent"):
        future.result()


class Gate:
    """A loopback port in front of the broker that refuses connections until opened: a client bootstrapping through
    it meets a broker that is away, then back (the broker's advertised address takes over once it answered)."""

    def __init__(self, target: str) -> None:
        host, port = target.split(",")[0].rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self.server: asyncio.Server | None = None

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, upstream_writer), copy(upstream_reader, writer))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_a_broker_away_at_the_first_use(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A client whose broker does not answer when it starts: ``submit()`` raises ``BrokerUnavailable`` after
    ``start_patience_s`` (not librdkafka's own exception), and ``unclaimed()`` — a task draining a previous life's
    results — waits for the broker instead of dying, then yields them."""
    caplog.set_level(logging.WARNING, logger="kiln.client")
    request_topic, results = topics(partitions=1)
    client_id = f"c-{unique}"
    async with KilnClient(kafka, client_id, results_topic=results):
        pass  # the previous life: its position is committed
    earlier = ResultEnvelope(request_id=new_request_id(), kind="echo", client_id=client_id, status="ok",
                             result={"data": "earlier"})
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    producer.produce(results, earlier.model_dump_json().encode(), key=client_id.encode(),
                     partition=zlib.crc32(client_id.encode()) % 2, headers=codec.result_headers(earlier.request_id))
    assert producer.flush(30) == 0
    gate = Gate(kafka.bootstrap_servers)
    away = kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{gate.port}"})
    client = KilnClient(away, client_id, results_topic=results, start_patience_s=1)
    try:
        with pytest.raises(BrokerUnavailable):
            await client.submit("echo", EchoRequest(data="x"), topic=request_topic)
        drained = asyncio.create_task(anext(client.unclaimed()))
        deadline = time.monotonic() + 60
        while "waiting for the broker to read its results" not in caplog.text:
            assert time.monotonic() < deadline and not drained.done()
            await asyncio.sleep(0.2)
        await gate.open()
        assert (await asyncio.wait_for(drained, 120)).request_id == earlier.request_id
    finally:
        await client.close()
        await gate.close()
