"""No single record halts a stage: whatever a record carries (key, headers, value, reply address of any size or
content), the worker runs it or dead-letters it once with the reason (bounded copies of key and headers, their
original sizes recorded, what does not fit claim-checked) and commits past it, and it stays up. Against the real
broker, with in-process workers (``Worker.failure`` is what would make a worker process exit)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import zstandard
from confluent_kafka import Consumer, Producer, TopicPartition

from kiln.schemas.builtin import EchoRequest, SleepRequest
from kiln.schemas.envelope import RequestEnvelope
from kiln.streams import admin, codec
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.client import KilnClient
from kiln.streams.deadletter import DLQ_HEADERS_LIMIT, DLQ_KEY_LIMIT
from kiln.streams.errors import RequestFailed
from kiln.streams.runtime import Worker
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import BROKER_TIME, TopicSpec
from kiln.workers.builtin import echo, sleep
from tests.streams.harness import read_all, running_worker

BIG = 1_200_000


def _envelope(results: str | None, kind: str = "echo", **changes: Any) -> bytes:
    body = json.loads(RequestEnvelope(kind=kind, client_id="mallory", payload={"data": "x"}).model_dump_json())
    if results is not None:
        body["reply_to"] = {"topic": results, "key": "mallory", "partition": 0}
    body.update(changes)
    return json.dumps(body).encode()


def _produce(settings: KilnSettings, topic: str, value: bytes, key: bytes | None = b"mallory",
             headers: list[tuple[str, bytes]] | None = None, timestamp: int = 0) -> None:
    """As a hostile producer would: large records allowed locally, compressed so the broker takes them."""
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "compression.type": "zstd",
                         "message.max.bytes": 10_000_000})
    producer.produce(topic, value, key=key, headers=headers, timestamp=timestamp)
    assert producer.flush(30) == 0


def _committed(settings: KilnSettings, group: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": group})
    try:
        return int(consumer.committed([TopicPartition(topic, 0)], timeout=10)[0].offset)
    finally:
        consumer.close()


async def _past(settings: KilnSettings, worker: Worker, topic: str, offset: int) -> None:
    """Until the worker's group has committed ``offset`` (everything below it finished, dead letters written)."""
    deadline = time.monotonic() + 60
    while _committed(settings, f"g-{topic}", topic) < offset:
        assert time.monotonic() < deadline, f"the worker never committed past offset {offset - 1}"
        assert worker.failure is None, worker.failure
        await asyncio.sleep(0.2)


async def _serves_after(settings: KilnSettings, worker: Worker, request_topic: str, results: str,
                        client_id: str) -> None:
    """The worker answers a good request after the bad one, commits past both, and is still up."""
    async with KilnClient(settings, client_id, results_topic=results) as client:
        after = await asyncio.wait_for(client.call("echo", EchoRequest(data="after"), topic=request_topic), 60)
    assert after.data == "after"
    await _past(settings, worker, request_topic, 2)
    assert worker.failure is None and worker.health()["status"] == "ok"


def _headers(record: Any) -> dict[str, bytes]:
    return dict(record.headers() or [])


OVERSIZED = {
    "a 1.2 MB key on a malformed value": dict(key=b"k" * BIG, value=b"\x00garbage", headers=None),
    "one 1.2 MB header": dict(key=b"mallory", value=b"\x00garbage", headers=[("big", b"h" * BIG)]),
    "an 899 KB malformed value with a 200 KB header": dict(key=b"mallory", value=b"v" * 899_000,
                                                         headers=[("h", b"h" * 200_000)]),
    "a header whose name is 100 KB": dict(key=b"mallory", value=b"\x00garbage", headers=[("n" * 100_000, b"v")]),
}


@pytest.mark.parametrize("case", list(OVERSIZED))
async def test_oversized_keys_and_headers_are_dead_lettered_once_in_bounds(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                           unique: str, tmp_path: Path,
                                                                           case: str) -> None:
    request_topic, results = topics(partitions=1)
    record = OVERSIZED[case]
    _produce(kafka, request_topic, record["value"], key=record["key"], headers=record["headers"])
    store = FileBlobStore(tmp_path / "blobs")
    async with running_worker(echo.stage, kafka, request_topic, slots=2, blob_store=store) as worker:
        await _serves_after(kafka, worker, request_topic, results, f"c-{unique}")
    dead = read_all(kafka, f"{request_topic}.dlq", expect=1, timeout=10)
    assert len(dead) == 1
    headers = _headers(dead[0])
    assert headers["kiln-error-type"] == b"MalformedRequest" and headers["kiln-source-offset"] == b"0"
    key = dead[0].key()
    assert key is not None and len(key) <= DLQ_KEY_LIMIT
    original = [(k, v) for k, v in dead[0].headers() or [] if not k.startswith("kiln-")]
    assert sum(len(k.encode()) + len(v or b"") for k, v in original) <= DLQ_HEADERS_LIMIT
    if len(record["key"]) > DLQ_KEY_LIMIT:
        assert headers["kiln-dlq-original-key-bytes"] == str(BIG).encode()
        assert store.get(headers["kiln-dlq-key-claim-check"].decode()) == record["key"]
    if record["headers"]:
        name, value = record["headers"][0]
        assert headers["kiln-dlq-original-headers-bytes"] == str(len(name) + len(value)).encode()
        kept = json.loads(store.get(headers["kiln-dlq-headers-claim-check"].decode()))
        assert kept == [[name, base64.b64encode(value).decode()]]
    assert dead[0].value() == record["value"]  # under the value limit: copied whole


async def test_a_valid_envelope_with_a_bad_payload_and_a_huge_key_fails_once(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                              unique: str) -> None:
    """No blob store: the key is only cut (its size recorded); the client would get the typed error."""
    request_topic, results = topics(partitions=1)
    _produce(kafka, request_topic, _envelope(results, payload={"not_a_field": 1}), key=b"k" * BIG)
    async with running_worker(echo.stage, kafka, request_topic, slots=2) as worker:
        await _serves_after(kafka, worker, request_topic, results, f"c-{unique}")
    dead = read_all(kafka, f"{request_topic}.dlq", expect=1, timeout=10)
    assert len(dead) == 1
    headers = _headers(dead[0])
    assert headers["kiln-error-type"] == b"MalformedRequest" and b"invalid echo payload" in headers[
        "kiln-error-message"]
    assert headers["kiln-dlq-original-key-bytes"] == str(BIG).encode() and len(dead[0].key() or b"") == DLQ_KEY_LIMIT
    errors = [r for r in read_all(kafka, results, expect=1, timeout=10) if b"mallory" in (r.value() or b"")]
    assert len(errors) == 1 and codec.decode_result(errors[0].value()).status == "error"


ADDRESSES = {
    "a reply topic of 600 characters": lambda request, results: _envelope(
        results, reply_to={"topic": "r" * 600, "key": "mallory"}),
    "a reply topic with a NUL byte": lambda request, results: _envelope(
        results, reply_to={"topic": "bad\x00topic", "key": "mallory"}),
    "no reply address": lambda request, results: _envelope(None),
    "the request topic as reply address": lambda request, results: _envelope(
        results, reply_to={"topic": request, "key": "mallory", "partition": 0}),
}


@pytest.mark.parametrize("case", list(ADDRESSES))
async def test_bad_reply_addresses_are_malformed_and_dead_lettered_once(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                        unique: str, case: str) -> None:
    request_topic, results = topics(partitions=1)
    _produce(kafka, request_topic, ADDRESSES[case](request_topic, results))
    async with running_worker(echo.stage, kafka, request_topic, slots=2) as worker:
        await _serves_after(kafka, worker, request_topic, results, f"c-{unique}")
    dead = read_all(kafka, f"{request_topic}.dlq", expect=1, timeout=10)
    assert len(dead) == 1
    assert _headers(dead[0])["kiln-error-type"] == b"MalformedRequest", _headers(dead[0])
    # Nothing came back as a request: the bad one and the good one are all the request topic holds.
    assert len(read_all(kafka, request_topic, expect=2, timeout=10)) == 2


async def test_payloads_are_strict_like_the_envelope(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1)
    async with running_worker(sleep.stage, kafka, request_topic, slots=2) as worker, \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        for coerced in ({"seconds": True}, {"seconds": "0.1"}, {"fail_attempts": 1.0}):
            with pytest.raises(RequestFailed, match="invalid sleep payload"):
                await asyncio.wait_for(client.call("sleep", coerced, topic=request_topic), 60)
        # What JSON carries natively still reads: an integer for a float.
        slept = await asyncio.wait_for(client.call("sleep", {"seconds": 0}, topic=request_topic), 60)
        assert slept.slept == 0.0 and worker.failure is None
    assert len(read_all(kafka, f"{request_topic}.dlq", expect=3, timeout=10)) == 3


async def test_a_claim_check_that_decompresses_without_bound_is_refused(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                        unique: str, tmp_path: Path) -> None:
    request_topic, results = topics(partitions=1)
    store = FileBlobStore(tmp_path / "blobs")
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (codec.CLAIM_CHECK_MAX_BYTES + (1 << 20)))
    assert len(bomb) < 64 * 1024
    ref = store.put(bomb)
    body = json.loads(_envelope(results).decode())
    del body["payload"]
    body["claim_check"] = {"digest": ref.digest, "size": ref.size}
    _produce(kafka, request_topic, json.dumps(body).encode())
    async with running_worker(echo.stage, kafka, request_topic, slots=2, blob_store=store) as worker:
        await _serves_after(kafka, worker, request_topic, results, f"c-{unique}")
    dead = read_all(kafka, f"{request_topic}.dlq", expect=1, timeout=10)
    assert len(dead) == 1 and b"decompresses to more than" in _headers(dead[0])["kiln-error-message"]


@pytest.fixture
def broker_time_topics(kafka: KilnSettings, unique: str):  # type: ignore[no-untyped-def]
    """A request topic stamped with the broker's clock (as ``kiln topics create`` makes them), its DLQ twin and a
    results topic; deleted afterwards."""
    request, results = f"req-{unique}", f"res-{unique}"
    admin.create_topics(kafka, [TopicSpec(request, 1, BROKER_TIME), TopicSpec(f"{request}.dlq", 1),
                                TopicSpec(results, 2, BROKER_TIME)])
    yield request, results
    admin.delete_topics(kafka, [request, f"{request}.dlq", results])


async def test_deadlines_are_durations_from_the_broker_timestamp(kafka: KilnSettings, broker_time_topics,  # type: ignore[no-untyped-def]
                                                                 unique: str) -> None:
    """A client an hour behind: its created_at and deadline are an hour early, and so is the timestamp its producer
    would set. With 60 s to run, the job runs; with no time at all, it expires (the budget is measured, not the
    clocks compared)."""
    request_topic, results = broker_time_topics
    behind = datetime.now(UTC) - timedelta(hours=1)
    for name, budget in (("roomy", 60), ("spent", 0)):
        _produce(kafka, request_topic, _envelope(
            results, request_id=f"{name}-{unique}", created_at=behind.isoformat(),
            deadline=(behind + timedelta(seconds=budget)).isoformat()), timestamp=int(behind.timestamp() * 1000))
    async with running_worker(echo.stage, kafka, request_topic, slots=2) as worker:
        records = await asyncio.to_thread(read_all, kafka, results, expect=2, timeout=60)
        answers = {codec.decode_result(r.value()).request_id: codec.decode_result(r.value()).status
                   for r in records}
        assert worker.failure is None
    assert answers == {f"roomy-{unique}": "ok", f"spent-{unique}": "expired"}


async def test_a_skewed_client_gets_its_results_and_is_warned(kafka: KilnSettings, broker_time_topics,  # type: ignore[no-untyped-def]
                                                              unique: str) -> None:
    request_topic, results = broker_time_topics
    async with running_worker(sleep.stage, kafka, request_topic, slots=2), \
            KilnClient(kafka, f"c-{unique}", results_topic=results, clock=lambda: time.time() - 3600) as client:
        got = await asyncio.wait_for(client.call("sleep", SleepRequest(seconds=0.01), topic=request_topic,
                                                 deadline_s=60), 60)
        assert got.slept == 0.01
        skew = client.clock_skew_s
    assert skew is not None and skew < -3000
