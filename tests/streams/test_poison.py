"""No input stops a worker: poison produced straight to a request topic (as an attacker or a buggy producer would)
is dead-lettered with its reason and committed past, and the worker goes on serving."""

from __future__ import annotations

import asyncio
import json

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kiln.schemas.builtin import EchoRequest
from kiln.schemas.envelope import RequestEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from tests.streams.harness import read_all


def _envelope(results: str, **changes: object) -> bytes:
    body = json.loads(RequestEnvelope(kind="echo", client_id="mallory", payload={"data": "x"}).model_dump_json())
    body["reply_to"] = {"topic": results, "key": "mallory", "partition": 0}
    body.update(changes)
    return json.dumps(body).encode()


POISON = {
    "deadline without a timezone": lambda results: _envelope(results, deadline="2030-01-01T00:00:00"),
    "5 MB of compressible bytes": lambda results: b"x" * 5_000_000,
    "reply_to a partition that does not exist": lambda results: _envelope(
        results, reply_to={"topic": results, "key": "mallory", "partition": 999}),
    "reply_to a topic that does not exist": lambda results: _envelope(
        results, reply_to={"topic": "no-such-topic", "key": "mallory"}),
}


@pytest.mark.parametrize("poison", list(POISON))
async def test_poison_is_dead_lettered_and_the_worker_goes_on(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                              poison: str) -> None:
    request_topic, results = topics(partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "compression.type": "zstd",
                         "message.max.bytes": 10_000_000})
    producer.produce(request_topic, POISON[poison](results), key=b"mallory")
    assert producer.flush(30) == 0
    with WorkerProcess("echo", kafka, request_topic, slots=2) as worker:
        worker.wait_assigned()
        async with KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
            after = await asyncio.wait_for(client.call("echo", EchoRequest(data="after"), topic=request_topic), 60)
        assert after.data == "after"
        assert worker.proc.poll() is None, worker.log.read_text()
        assert worker.terminate() == 0
    dead = read_all(kafka, f"{request_topic}.dlq", expect=1, timeout=10)
    assert len(dead) == 1, worker.log.read_text()
    headers = dict(dead[0].headers() or [])
    assert headers["kiln-error-type"] and headers["kiln-source-offset"] == b"0"
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"g-{request_topic}"})
    committed = consumer.committed([TopicPartition(request_topic, 0)], timeout=10)[0]
    consumer.close()
    assert committed.offset == 2  # the poison and the good job: nothing left to replay
