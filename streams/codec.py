"""Envelope (de)serialisation, with claim checks for payloads above the size threshold."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import zstandard
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from kiln.schemas.envelope import (
    SCHEMA_VERSION,
    ClaimCheck,
    ErrorInfo,
    ReplyTo,
    RequestEnvelope,
    ResultEnvelope,
    ResultStatus,
)
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import MalformedRequest

_ZSTD_LEVEL = 3
CLAIM_CHECK_MAX_BYTES = 64 << 20
"""The most a claim check may decompress to: a small blob that expands without bound (a zstd bomb) is refused
before it is held in memory."""


def _check_in(data: dict[str, Any], store: BlobStore) -> ClaimCheck:
    raw = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(json.dumps(data).encode())
    ref = store.put(raw)
    return ClaimCheck(digest=ref.digest, size=ref.size)


def bounded_decompress(packed: bytes, limit: int, what: str) -> bytes:
    """``packed`` (one or more zstd frames) decompressed, or ``MalformedRequest`` when it is not zstd or would
    decompress to more than ``limit`` bytes; never more than ``limit + 1`` bytes are held."""
    try:
        with zstandard.ZstdDecompressor().stream_reader(packed, read_across_frames=True) as reader:
            parts: list[bytes] = []
            held = 0
            while held <= limit and (part := reader.read(limit + 1 - held)):
                parts.append(part)
                held += len(part)
    except zstandard.ZstdError as e:
        raise MalformedRequest(f"{what} does not decompress: {e}") from None
    raw = b"".join(parts)
    if len(raw) > limit:
        raise MalformedRequest(f"{what} decompresses to more than {limit} bytes")
    return raw


def _check_out(check: ClaimCheck, store: BlobStore | None) -> dict[str, Any]:
    if store is None:
        raise MalformedRequest("message carries a claim check but no blob store is configured")
    raw = bounded_decompress(store.get(check.digest), CLAIM_CHECK_MAX_BYTES, f"claim check {check.digest}")
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise MalformedRequest(f"claim-checked payload is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise MalformedRequest("claim-checked payload is not an object")
    return data


def encode(envelope: RequestEnvelope | ResultEnvelope, store: BlobStore | None, threshold: int) -> bytes:
    """JSON bytes of the envelope; a payload/result above ``threshold`` bytes moves to the blob store."""
    raw = envelope.model_dump_json().encode()
    if len(raw) <= threshold or store is None:
        return raw
    field = "payload" if isinstance(envelope, RequestEnvelope) else "result"
    body = getattr(envelope, field)
    if body is None:
        return raw
    slim = envelope.model_copy(update={field: None, "claim_check": _check_in(body, store)})
    return slim.model_dump_json().encode()


# What a request must carry explicitly: a default here would turn a broken producer's message into a job.
_REQUIRED = ("request_id", "kind", "schema_version", "created_at", "client_id", "attempt")


def decode_request(raw: bytes | None) -> RequestEnvelope:
    """A request envelope, validated strictly (no type coercion; known schema version; required fields present;
    exactly one of payload and claim check), or ``MalformedRequest`` saying why."""
    if raw is None:
        raise MalformedRequest("empty message (tombstone)")
    try:
        envelope = RequestEnvelope.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise MalformedRequest(f"not a request envelope: {_short(e)}") from None
    missing = [name for name in _REQUIRED if name not in envelope.model_fields_set]
    if missing:
        raise MalformedRequest(f"not a request envelope: missing {', '.join(missing)}")
    if (envelope.payload is None) == (envelope.claim_check is None):
        raise MalformedRequest("not a request envelope: exactly one of payload and claim_check is required")
    return envelope


def request_json(request_id: str, kind: str, client_id: str, created_at: datetime, reply_to: ReplyTo | None,
                 payload: BaseModel | dict[str, Any]) -> bytes:
    """The JSON of a ``RequestEnvelope`` with these fields (and no deadline, lane or redrive), serialised without
    building one, for a client sending a registered stage's request with its own id, clock and reply address. The
    same bytes as ``RequestEnvelope(...).model_dump_json()`` (tests/streams/test_fast_path.py holds them to it)."""
    return to_json({
        "request_id": request_id, "kind": kind, "schema_version": SCHEMA_VERSION, "created_at": created_at,
        "deadline": None, "attempt": 0, "client_id": client_id, "reply_to": reply_to, "payload": payload,
        "claim_check": None, "lane": None, "redriven_from": None,
    }, by_alias=False)


def result_json(request: RequestEnvelope, status: ResultStatus, result: BaseModel | None, error: ErrorInfo | None,
                attempts: int, worker: str, started_at: datetime, finished_at: datetime) -> bytes:
    """The JSON of the ``ResultEnvelope`` answering ``request``, serialised without building one: its fields come
    from a validated request and the worker itself, so validating them again is waste on every job's path. The same
    bytes as ``ResultEnvelope(...).model_dump_json()`` (tests/streams/test_fast_path.py holds them to it)."""
    return to_json({
        "request_id": request.request_id, "kind": request.kind, "schema_version": SCHEMA_VERSION,
        "client_id": request.client_id, "status": status, "result": result, "claim_check": None, "error": error,
        "attempts": attempts, "worker": worker, "started_at": started_at, "finished_at": finished_at,
        "redriven_from": request.redriven_from,
    }, by_alias=False)


def decode_result(raw: bytes) -> ResultEnvelope:
    return ResultEnvelope.model_validate_json(raw)


def request_payload(envelope: RequestEnvelope, model: type[BaseModel], store: BlobStore | None) -> BaseModel:
    """The envelope's payload validated against the stage's request model (fetching a claim check), strictly as the
    envelope is: pydantic's strict JSON mode, so no coercion (``true`` is no number, ``"1"`` no integer); what JSON
    cannot carry natively is read from its JSON form (a datetime or enum from its string, a tuple from an array, an
    integer as a float)."""
    data = _check_out(envelope.claim_check, store) if envelope.claim_check else (envelope.payload or {})
    try:
        # Back to JSON (pydantic's serialiser: a fifth of json.dumps's time on every job; NaN and the infinities
        # kept as JSON's parser read them) to validate in JSON mode.
        return model.model_validate_json(to_json(data, inf_nan_mode="constants"), strict=True)
    except ValidationError as e:
        raise MalformedRequest(f"invalid {envelope.kind} payload: {_short(e)}") from None


def result_body(envelope: ResultEnvelope, store: BlobStore | None) -> dict[str, Any] | None:
    if envelope.claim_check:
        return _check_out(envelope.claim_check, store)
    return envelope.result


def _short(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:5])


REQUEST_ID_HEADER = "kiln-request-id"
"""Every result record names its request id in this header, so a client can recall which requests a previous life
received without decoding the results (see ``KilnClient``'s ``dedup_lookback_s``)."""


def result_headers(request_id: str) -> list[tuple[str, bytes]]:
    return [(REQUEST_ID_HEADER, request_id.encode())]


RecordHeaders = list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None] | None

LANE_HEADER = "kiln-lane"
"""A request's lane (``RequestEnvelope.lane``) as a header: workers schedule by it before decoding the value."""


CLIENT_HEADER = "kiln-client"
"""A request's ``client_id`` as a header: workers queue fairly per client before decoding the value. Like the
envelope's field, the client asserts it; fairness is between clients that do not lie about who they are."""


def header_value(headers: RecordHeaders, wanted: str) -> str | None:
    """The first non-empty value of header ``wanted``, as text."""
    pairs = headers.items() if isinstance(headers, dict) else headers or []
    for name, raw in pairs:
        if name == wanted and raw:
            return raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return None


def lane_of(headers: RecordHeaders) -> str | None:
    return header_value(headers, LANE_HEADER)


def request_headers(client_id: str, lane: str | None) -> list[tuple[str, bytes]]:
    """The headers a request carries for scheduling: its client, and its lane when it has one."""
    headers = [(CLIENT_HEADER, client_id.encode())]
    if lane:
        headers.append((LANE_HEADER, lane.encode()))
    return headers


def result_request_id(value: bytes, headers: RecordHeaders) -> str | None:
    """The request id a result record answers: from its header, or (records without one) its decoded envelope;
    None for a record that is not a result."""
    pairs = headers.items() if isinstance(headers, dict) else headers or []
    for name, raw in pairs:
        if name == REQUEST_ID_HEADER and raw:
            return raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        return decode_result(value).request_id
    except Exception:
        return None
