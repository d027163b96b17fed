"""Request envelopes are validated strictly at the edge: an unknown major version, a missing required field, a
wrong type or an absurd value is malformed input (dead-lettered with the reason), never defaulted into a job."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from kiln.schemas.builtin import EchoRequest, EchoResult
from kiln.schemas.envelope import ErrorInfo, ReplyTo, RequestEnvelope, ResultEnvelope
from kiln.streams import codec
from kiln.streams.errors import MalformedRequest


def _wire(**changes: Any) -> bytes:
    """A request as the client sends it, with ``changes`` applied (``None`` removes a field)."""
    body = json.loads(RequestEnvelope(kind="echo", client_id="c", payload={"data": 1}).model_dump_json())
    for name, value in changes.items():
        if value is None:
            body.pop(name, None)
        else:
            body[name] = value
    return json.dumps(body).encode()


def test_what_the_client_sends_decodes() -> None:
    envelope = codec.decode_request(_wire())
    assert envelope.kind == "echo" and envelope.payload == {"data": 1} and envelope.schema_version == 1
    soon = (datetime.now(UTC) + timedelta(seconds=30)).isoformat()
    assert codec.decode_request(_wire(deadline=soon)).deadline is not None


@pytest.mark.parametrize("changes", [
    {"schema_version": 0}, {"schema_version": 2}, {"schema_version": 999}, {"schema_version": -1},
    {"schema_version": "1"}, {"schema_version": True},
    {"payload": None}, {"request_id": None}, {"created_at": None}, {"client_id": None}, {"attempt": None},
    {"schema_version": None}, {"kind": None},
    {"attempt": 2**70}, {"attempt": True}, {"attempt": "0"}, {"attempt": -1},
    {"created_at": "9999-12-31T23:59:59+00:00"}, {"created_at": "2026-01-01T00:00:00"},
    {"deadline": "2030-01-01T00:00:00"}, {"deadline": "9999-12-31T23:59:59+00:00"},
    {"payload": [1, 2]}, {"payload": "x"},
    {"claim_check": {"digest": "sha256:" + "0" * 64, "size": 3}},  # both payload and claim check
    {"reply_to": {"topic": "", "key": "k"}}, {"reply_to": {"topic": "t", "key": "k", "partition": 2**40}},
], ids=lambda c: ",".join(f"{k}={str(v)[:20]}" for k, v in c.items()))
def test_bad_envelopes_are_malformed(changes: dict[str, Any]) -> None:
    with pytest.raises(MalformedRequest):
        codec.decode_request(_wire(**changes))


@pytest.mark.parametrize("raw", [b"", b"null", b"[]", b"{", b"\xff\xfe", b"x" * 1000])
def test_non_envelopes_are_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedRequest):
        codec.decode_request(raw)


AT = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


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
    fast = codec.result_json(request, status, result, error, 3, "worker-1", AT, AT + timedelta(seconds=1))
    reference = ResultEnvelope(
        request_id=request.request_id, kind="echo", client_id=request.client_id, status=status,
        result=result.model_dump(mode="json") if result is not None else None, error=error, attempts=3,
        worker="worker-1", started_at=AT, finished_at=AT + timedelta(seconds=1), redriven_from=redriven_from)
    assert fast == reference.model_dump_json().encode()


@pytest.mark.parametrize("payload", [EchoRequest(data={"ü": [1, 2.5, None, "\"q\"\n"]}), {"data": None, "at": AT}])
def test_request_json_is_the_request_envelope_pydantic_would_write(payload: BaseModel | dict[str, Any]) -> None:
    reply_to = ReplyTo(topic="res", key="clïent", partition=3)
    fast = codec.request_json("01ID", "echo", "clïent", AT, reply_to, payload)
    body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    reference = RequestEnvelope(request_id="01ID", kind="echo", client_id="clïent", created_at=AT,
                                reply_to=reply_to, payload=body)
    assert fast == reference.model_dump_json().encode()
    assert codec.decode_request(fast).payload == json.loads(fast)["payload"]  # and it passes the edge's checks
