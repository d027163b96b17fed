"""The job runtime on a real broker: results, head-of-line freedom, keyed order, retries, DLQ, deadlines."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from confluent_kafka import Producer

from kiln.schemas.builtin import EchoRequest, EchoResult, SleepRequest
from kiln.schemas.envelope import ReplyTo, RequestEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.errors import PermanentJobError, RequestExpired, RequestFailed, TransientJobError
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.builtin import echo, sleep
from tests.streams.harness import committed, read_all, running_worker


@pytest.mark.parametrize("protocol", ["consumer", "classic"])
async def test_echo_round_trip_and_out_of_order(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                protocol: str) -> None:
    request_topic, results = topics(partitions=4)
    settings = kafka.model_copy(update={"group_protocol": protocol})  # KIP-848, and the classic protocol
    async with running_worker(echo.stage, settings, request_topic, slots=8), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        futures = [await client.submit("echo", EchoRequest(data={"i": i}), topic=request_topic) for i in range(200)]
        envelopes = await asyncio.wait_for(asyncio.gather(*futures), 30)
    assert [client.result_of(e).data for e in envelopes] == [{"i": i} for i in range(200)]
    assert len({e.request_id for e in envelopes}) == 200


async def test_fast_jobs_are_not_blocked_by_a_slow_one(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1)
    async with running_worker(sleep.stage, kafka, request_topic, slots=4), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        slow = await client.submit("sleep", SleepRequest(seconds=4, tag="slow"), topic=request_topic)
        fast = [await client.submit("sleep", SleepRequest(seconds=0.02, tag=f"f{i}"), topic=request_topic)
                for i in range(30)]
        fast_results = await asyncio.wait_for(asyncio.gather(*fast), 60)
        slow_result = await asyncio.wait_for(slow, 60)
    # Blocked behind the slow job, no fast one could finish before it did: all of them did (the worker's times).
    assert all(r.finished_at < slow_result.finished_at for r in fast_results), \
        "the slow job finished first: the fast ones were blocked behind it"


async def test_keyed_mode_keeps_per_key_order_under_concurrency(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                unique: str) -> None:
    request_topic, results = topics(partitions=2)
    order: dict[str, list[int]] = defaultdict(list)
    running = {"now": 0, "peak": 0}

    async def handle(request: EchoRequest, ctx: JobContext) -> EchoResult:
        running["now"] += 1
        running["peak"] = max(running["peak"], running["now"])
        await asyncio.sleep(0.01 * (request.data["seq"] % 3))
        order[request.data["key"]].append(request.data["seq"])
        running["now"] -= 1
        return EchoResult(data=None)

    from kiln.schemas.builtin import EchoResult

    keyed = Stage(dataclasses.replace(echo.stage.spec, ordering="keyed"), handle)  # type: ignore[arg-type]
    async with running_worker(keyed, kafka, request_topic, slots=8), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        futures = [await client.submit("echo", EchoRequest(data={"key": f"k{i % 4}", "seq": i}),
                                       topic=request_topic, key=f"k{i % 4}") for i in range(120)]
        await asyncio.wait_for(asyncio.gather(*futures), 30)
    for key, seqs in order.items():
        assert seqs == sorted(seqs), f"key {key} ran out of order"
    assert sum(len(s) for s in order.values()) == 120
    assert running["peak"] > 1, "keyed mode ran everything serially"


async def test_transient_failures_retry_then_succeed_or_dead_letter(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                     unique: str) -> None:
    request_topic, results = topics(partitions=1)
    async with running_worker(sleep.stage, kafka, request_topic, slots=2), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        recovered = await client.call("sleep", SleepRequest(fail="transient", fail_attempts=1), topic=request_topic)
        assert recovered.attempt == 2
        with pytest.raises(RequestFailed, match="TransientJobError"):
            await client.call("sleep", SleepRequest(fail="transient", tag="doomed"), topic=request_topic)
        with pytest.raises(RequestFailed, match="PermanentJobError"):
            await client.call("sleep", SleepRequest(fail="permanent", tag="poison"), topic=request_topic)
    dlq = read_all(kafka, f"{request_topic}.dlq", expect=2)
    assert len(dlq) == 2
    headers = [dict(m.headers()) for m in dlq]
    by_type = {h["kiln-error-type"].decode(): h for h in headers}
    assert by_type["TransientJobError"]["kiln-attempts"] == b"3"
    assert by_type["PermanentJobError"]["kiln-attempts"] == b"1"
    for h in headers:
        assert h["kiln-stage"] == b"sleep"
        assert h["kiln-source-topic"] == request_topic.encode()
        assert h["kiln-source-partition"] == b"0"
        assert int(h["kiln-source-offset"]) in (1, 2)


async def test_malformed_input_goes_to_dlq_and_worker_keeps_going(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                  unique: str) -> None:
    request_topic, results = topics(partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    producer.produce(request_topic, b"\x00 not json")
    producer.produce(request_topic, json.dumps({"kind": "echo", "payload": {"unexpected": 1}}).encode())
    producer.flush(10)
    async with running_worker(echo.stage, kafka, request_topic, slots=2), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        with pytest.raises(RequestFailed, match="MalformedRequest"):
            await client.call("echo", {"data": 1, "extra": "field"}, topic=request_topic)
        ok = await client.call("echo", EchoRequest(data="still alive"), topic=request_topic)
        assert ok.data == "still alive"
    dlq = read_all(kafka, f"{request_topic}.dlq", expect=3)
    assert next(m.value()[:9] for m in dlq) == b"\x00 not jso"
    assert {dict(m.headers())["kiln-error-type"] for m in dlq} == {b"MalformedRequest"}
    # Garbage bytes and an envelope missing its required fields are never attempted; an invalid payload fails on
    # its first attempt and is not retried. (In any order: the client's request may start before the second of the
    # anonymous ones, fair queueing between clients, when one poll brings all three.)
    assert len(dlq) == 3 and sorted(dict(m.headers())["kiln-attempts"] for m in dlq) == [b"0", b"0", b"1"]


async def test_expired_requests_are_answered_not_run(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                     tmp_path) -> None:
    request_topic, results = topics(partitions=1)
    async with running_worker(sleep.stage, kafka, request_topic, slots=1), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        blocker = await client.submit("sleep", SleepRequest(seconds=2), topic=request_topic)
        late = await client.submit("sleep", SleepRequest(seconds=0, tag="late"), topic=request_topic,
                                   deadline_s=0.5)
        with pytest.raises(RequestExpired):
            client.result_of(await asyncio.wait_for(late, 10))
        await blocker
    raw = [json.loads(m.value()) for m in read_all(kafka, results, expect=2)]
    assert len(raw) == 2
    late_result = next(r for r in raw if r["status"] == "expired")
    assert late_result["attempts"] == 0 and late_result["result"] is None


async def test_hung_job_is_timed_out_and_dead_lettered(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1)
    hanging = dataclasses.replace(sleep.stage, job_timeout_s=0.3, max_attempts=2)
    async with running_worker(hanging, kafka, request_topic, slots=2), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        with pytest.raises(RequestFailed, match="exceeded"):
            await client.call("sleep", SleepRequest(fail="hang"), topic=request_topic)
        assert (await client.call("sleep", SleepRequest(), topic=request_topic)).attempt == 1


async def test_metrics_and_health_endpoint(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=2)
    async with running_worker(echo.stage, kafka, request_topic, slots=3) as worker, \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        for i in range(5):
            await client.call("echo", EchoRequest(data=i), topic=request_topic)
        async with httpx.AsyncClient() as http:
            health = (await http.get(f"http://127.0.0.1:{worker.metrics_port}/healthz")).json()
            metrics = (await http.get(f"http://127.0.0.1:{worker.metrics_port}/metrics")).text
    assert health["status"] == "ok" and health["slots"] == 3 and health["partitions"] == [0, 1]
    assert 'kiln_completions_total{stage="echo"' in metrics
    assert "kiln_completions_last_minute" in metrics and "kiln_queue_length" in metrics
    assert "kiln_busy_slots" in metrics
    line = next(m for m in metrics.splitlines() if m.startswith("kiln_completions_last_minute"))
    assert float(line.split()[-1]) == 5.0


def _request(results: str, data: Any) -> bytes:
    return RequestEnvelope(kind="echo", client_id="c", reply_to=ReplyTo(topic=results, key="c", partition=0),
                           payload={"data": data}).model_dump_json().encode()


async def test_a_malformed_record_in_a_batch_is_dead_lettered_and_the_rest_succeed(
        kafka: KilnSettings, topics) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1, results_partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 50})
    records = [_request(results, i) for i in range(20)]
    records += [b"\x00 not json", RequestEnvelope(kind="echo", client_id="c", payload={"data": 1, "extra": 2},
                                                   reply_to=ReplyTo(topic=results, key="c", partition=0)
                                                   ).model_dump_json().encode()]
    records += [_request(results, i) for i in range(20, 40)]
    for value in records:  # all in the topic before the worker starts: it takes them in one batch
        producer.produce(request_topic, value)
    producer.flush(10)
    async with running_worker(echo.stage, kafka, request_topic, slots=64):
        replies = [json.loads(m.value()) for m in await asyncio.to_thread(read_all, kafka, results, 41)]
    oks = sorted(r["result"]["data"] for r in replies if r["status"] == "ok")
    assert oks == list(range(40)) and len(replies) == 41
    failed = next(r for r in replies if r["status"] == "error")
    assert failed["error"]["type"] == "MalformedRequest" and "invalid echo payload" in failed["error"]["message"]
    dlq = read_all(kafka, f"{request_topic}.dlq", expect=2)
    reasons = {int(dict(m.headers())["kiln-source-offset"]): dict(m.headers())["kiln-error-message"] for m in dlq}
    assert len(dlq) == 2 and set(reasons) == {20, 21}
    assert reasons[20].startswith(b"not a request envelope") and b"invalid echo payload" in reasons[21]
    # Commit after finish: the stop waited for the last results' delivery and committed past every record.
    assert committed(kafka, f"g-{request_topic}", request_topic) == len(records)


async def test_jobs_that_raise_wait_or_expire_keep_retries_timeouts_deadlines_and_dead_letters(
        kafka: KilnSettings, topics) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1, results_partitions=1)
    seen: dict[str, list[int]] = {}

    async def handle(request: EchoRequest, ctx: JobContext) -> EchoResult:
        what = request.data
        seen.setdefault(what, []).append(ctx.attempt)
        if what == "transient" and ctx.attempt == 1:
            raise TransientJobError("first attempt fails")
        if what == "permanent":
            raise PermanentJobError("never works")
        if what == "waits":
            await asyncio.sleep(0.05)
        if what == "hangs":
            await asyncio.Event().wait()
        if what == "unserialisable":
            return EchoResult(data=object())
        return EchoResult(data=what)

    stage = Stage(echo.stage.spec, handle, job_timeout_s=0.5, max_attempts=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for what in ("transient", "permanent", "waits", "hangs", "fine", "unserialisable"):
        producer.produce(request_topic, _request(results, what))
    past = datetime.now(UTC) - timedelta(seconds=10)
    producer.produce(request_topic, RequestEnvelope(
        kind="echo", client_id="c", reply_to=ReplyTo(topic=results, key="c", partition=0), payload={"data": "late"},
        created_at=past, deadline=past + timedelta(seconds=1)).model_dump_json().encode())
    producer.flush(10)
    async with running_worker(stage, kafka, request_topic, slots=8):
        replies = {(r := json.loads(m.value()))["request_id"]: r
                   for m in await asyncio.to_thread(read_all, kafka, results, 7)}
        dlq = await asyncio.to_thread(read_all, kafka, f"{request_topic}.dlq", 3)
    by_data = {r["result"]["data"] if r["result"] else r["error"]["message"]: r for r in replies.values()}
    assert len(replies) == 7
    expired = next(r for r in replies.values() if r["status"] == "expired")
    assert expired["attempts"] == 0 and "late" not in seen  # answered, never run
    assert by_data["transient"]["attempts"] == 2 and seen["transient"] == [1, 2]
    assert by_data["waits"]["status"] == "ok" and by_data["waits"]["attempts"] == 1
    assert by_data["fine"]["attempts"] == 1 and seen["fine"] == [1]
    assert by_data["never works"]["status"] == "error" and by_data["never works"]["attempts"] == 1
    hung = next(r for r in replies.values() if r["error"] and "exceeded" in r["error"]["message"])
    assert hung["attempts"] == 2 and seen["hangs"] == [1, 2]
    unsent = next(r for r in replies.values() if r["error"] and r["error"]["type"] == "ReplyDeliveryFailed")
    assert seen["unserialisable"] == [1] and "unserialisable" not in by_data
    assert sorted(dict(m.headers())["kiln-attempts"] for m in dlq) == [b"1", b"1", b"2"]
    assert {dict(m.headers())["kiln-error-type"] for m in dlq} == {b"PermanentJobError", b"TransientJobError",
                                                                    b"ReplyDeliveryFailed"} and unsent
    assert committed(kafka, f"g-{request_topic}", request_topic) == 7
