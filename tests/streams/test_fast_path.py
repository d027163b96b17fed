"""The dispatch fast path: jobs of a non-blocking handler run inline (no task each), with the runtime's guarantees
intact: malformed input dead-lettered with its reason, retries, timeouts, commit after the result is delivered."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from confluent_kafka import Message, Producer
from pydantic import BaseModel

from kiln.schemas.builtin import EchoRequest, EchoResult
from kiln.schemas.envelope import ErrorInfo, ReplyTo, RequestEnvelope, ResultEnvelope
from kiln.streams import codec
from kiln.streams.errors import PermanentJobError, TransientJobError
from kiln.streams.executor import JobExecutor
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.middleware import InlineChain, MetricsMiddleware, default_middleware
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.builtin import echo
from tests.streams.harness import committed, read_all, running_worker

NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


@pytest.mark.parametrize(("status", "result", "error", "redriven_from"), [
    ("ok", EchoResult(data={"ü": [1, 2.5, None, "\"quoted\"\n"]}), None, None),
    ("error", None, ErrorInfo(type="TransientJobError", message="x" * 300, retryable=True), "01REDRIVEN"),
    ("expired", None, ErrorInfo(type="RequestExpired", message="deadline passed before start"), None),
])
def test_result_json_is_the_result_envelope_pydantic_would_write(status: Any, result: BaseModel | None,
                                                                 error: ErrorInfo | None,
                                                                 redriven_from: str | None) -> None:
    request = RequestEnvelope(kind="echo", client_id="clïent \"7\"", payload={}, redriven_from=redriven_from,
                              reply_to=ReplyTo(topic="res", key="k"))
    fast = codec.result_json(request, status, result, error, 3, "worker-1", NOW, NOW + timedelta(seconds=1))
    reference = ResultEnvelope(
        request_id=request.request_id, kind="echo", client_id=request.client_id, status=status,
        result=result.model_dump(mode="json") if result is not None else None, error=error, attempts=3,
        worker="worker-1", started_at=NOW, finished_at=NOW + timedelta(seconds=1), redriven_from=redriven_from)
    assert fast == reference.model_dump_json().encode()


@pytest.mark.parametrize("payload", [EchoRequest(data={"ü": [1, 2.5, None, "\"q\"\n"]}), {"data": None, "at": NOW}])
def test_request_json_is_the_request_envelope_pydantic_would_write(payload: BaseModel | dict[str, Any]) -> None:
    reply_to = ReplyTo(topic="res", key="clïent", partition=3)
    fast = codec.request_json("01ID", "echo", "clïent", NOW, reply_to, payload)
    body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    reference = RequestEnvelope(request_id="01ID", kind="echo", client_id="clïent", created_at=NOW,
                                reply_to=reply_to, payload=body)
    assert fast == reference.model_dump_json().encode()
    assert codec.decode_request(fast).payload == json.loads(fast)["payload"]  # and it passes the edge's checks


def _request(results: str, data: Any) -> bytes:
    return RequestEnvelope(kind="echo", client_id="c", reply_to=ReplyTo(topic=results, key="c", partition=0),
                           payload={"data": data}).model_dump_json().encode()


async def test_a_malformed_record_in_an_inline_batch_is_dead_lettered_and_the_rest_succeed(
        kafka: KilnSettings, topics) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1, results_partitions=1)
    inline: list[bool] = []

    async def handle(request: EchoRequest, ctx: JobContext) -> EchoResult:
        inline.append(asyncio.current_task() is None)
        return EchoResult(data=request.data)

    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 50})
    records = [_request(results, i) for i in range(20)]
    records += [b"\x00 not json", RequestEnvelope(kind="echo", client_id="c", payload={"data": 1, "extra": 2},
                                                   reply_to=ReplyTo(topic=results, key="c", partition=0)
                                                   ).model_dump_json().encode()]
    records += [_request(results, i) for i in range(20, 40)]
    for value in records:  # all in the topic before the worker starts: it takes them in one batch
        producer.produce(request_topic, value)
    producer.flush(10)
    async with running_worker(Stage(echo.stage.spec, handle, nonblocking=True), kafka, request_topic, slots=64):
        replies = [json.loads(m.value()) for m in await asyncio.to_thread(read_all, kafka, results, 41)]
    oks = sorted(r["result"]["data"] for r in replies if r["status"] == "ok")
    assert oks == list(range(40)) and len(replies) == 41
    assert all(inline) and len(inline) == 40, "the handler ran in a task: the fast path was not taken"
    failed = next(r for r in replies if r["status"] == "error")
    assert failed["error"]["type"] == "MalformedRequest" and "invalid echo payload" in failed["error"]["message"]
    dlq = read_all(kafka, f"{request_topic}.dlq", expect=2)
    reasons = {int(dict(m.headers())["kiln-source-offset"]): dict(m.headers())["kiln-error-message"] for m in dlq}
    assert len(dlq) == 2 and set(reasons) == {20, 21}
    assert reasons[20].startswith(b"not a request envelope") and b"invalid echo payload" in reasons[21]
    # Commit after finish: the stop waited for the last results' delivery and committed past every record.
    assert committed(kafka, f"g-{request_topic}", request_topic) == len(records)


async def test_inline_jobs_that_raise_wait_or_expire_keep_retries_timeouts_deadlines_and_dead_letters(
        kafka: KilnSettings, topics) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1, results_partitions=1)
    seen: dict[str, list[tuple[int, bool]]] = {}

    async def handle(request: EchoRequest, ctx: JobContext) -> EchoResult:
        what = request.data
        seen.setdefault(what, []).append((ctx.attempt, asyncio.current_task() is None))
        if what == "transient" and ctx.attempt == 1:
            raise TransientJobError("first attempt fails")
        if what == "permanent":
            raise PermanentJobError("never works")
        if what == "waits":  # declared non-blocking, waits anyway: it goes on as a task
            await asyncio.sleep(0.05)
        if what == "hangs":
            await asyncio.Event().wait()
        if what == "unserialisable":
            return EchoResult(data=object())
        return EchoResult(data=what)

    stage = Stage(echo.stage.spec, handle, nonblocking=True, job_timeout_s=0.5, max_attempts=2)
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
    assert by_data["transient"]["attempts"] == 2 and seen["transient"][0] == (1, True)
    assert by_data["waits"]["status"] == "ok" and by_data["waits"]["attempts"] == 1
    assert by_data["fine"]["attempts"] == 1 and seen["fine"] == [(1, True)]
    assert by_data["never works"]["status"] == "error" and by_data["never works"]["attempts"] == 1
    hung = next(r for r in replies.values() if r["error"] and "exceeded" in r["error"]["message"])
    assert hung["attempts"] == 2 and [a for a, _ in seen["hangs"]] == [1, 2]
    unsent = next(r for r in replies.values() if r["error"] and r["error"]["type"] == "ReplyDeliveryFailed")
    assert seen["unserialisable"] == [(1, True)] and "unserialisable" not in by_data
    assert sorted(dict(m.headers())["kiln-attempts"] for m in dlq) == [b"1", b"1", b"2"]
    assert {dict(m.headers())["kiln-error-type"] for m in dlq} == {b"PermanentJobError", b"TransientJobError",
                                                                    b"ReplyDeliveryFailed"} and unsent
    assert committed(kafka, f"g-{request_topic}", request_topic) == 7


async def test_an_inline_job_finishes_when_its_result_is_delivered_and_a_revoke_waits_for_that(
        kafka: KilnSettings, topics) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1, results_partitions=1)
    executor = JobExecutor(echo.stage, kafka, WorkerMetrics("echo", f"w-{uuid.uuid4().hex[:6]}"), "w",
                           f"{request_topic}.dlq")
    await executor.start(asyncio.get_running_loop(), 4)
    finished: list[int] = []
    resumed: list[object] = []
    try:
        assert await executor.partitions(results) == 1  # a destination seen once: no lookup on the job's path
        for offset in range(3):
            msg = Message(topic=request_topic, partition=0, offset=offset, value=_request(results, offset))
            assert executor.run_inline(msg, lambda: None, lambda o=offset: finished.append(o),  # type: ignore[misc]
                                       lambda rest, context: resumed.append(rest))
        waits = executor.unsettled(request_topic, 0)
        assert waits is not None and executor.unsettled(request_topic, 0) is None  # one waiter per period
        assert finished == []  # produced, not yet delivered: not finished (its offset is not committed)
        await asyncio.wait_for(waits(), 30)
        assert sorted(finished) == [0, 1, 2] and resumed == []
        assert executor.unsettled(request_topic, 0) is None  # nothing left to wait for
    finally:
        await executor.close()
    replies = [json.loads(m.value()) for m in await asyncio.to_thread(read_all, kafka, results, 3)]
    assert sorted(r["result"]["data"] for r in replies) == [0, 1, 2]


def test_a_stage_is_inline_only_when_it_says_its_handler_never_waits() -> None:
    metrics = WorkerMetrics("echo", f"w-{uuid.uuid4().hex[:6]}")
    blocking = Stage(echo.stage.spec, echo.handle)
    assert InlineChain.of(blocking, default_middleware(metrics), None) is None
    assert InlineChain.of(echo.stage, default_middleware(metrics), None) is not None

    async def custom(job: Any, call_next: Any) -> Any:
        return await call_next(job)

    # A middleware that is no Policy has only its coroutine form: every job goes through it as a task.
    assert InlineChain.of(echo.stage, [MetricsMiddleware(metrics), custom], None) is None
