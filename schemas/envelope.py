"""The message envelope every kiln request and result travels in.

Pydantic models are the source of truth; ``python -m kiln.schemas.export`` writes their JSON Schema under
``schemas/jsonschema/`` and a test fails when a change would break readers of an earlier version.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1
MAX_ATTEMPT = 1000
CLOCK_SKEW = timedelta(days=1)
"""How far in the future a request's ``created_at`` may be (producers' clocks differ)."""
MAX_DEADLINE = timedelta(days=366)

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DIGIT_PAIRS = [high + low for high in _CROCKFORD for low in _CROCKFORD]
_PAIR_SHIFTS = range(120, -1, -10)  # 13 pairs: 130 bits, the top two zero
_id_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_request_id() -> str:
    """A ULID: 48-bit millisecond time + 80 random bits, Crockford base32; monotonic within a process."""
    global _last_ms, _counter
    with _id_lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            ms = _last_ms
            _counter += 1
        else:
            _last_ms, _counter = ms, int.from_bytes(os.urandom(8), "big") >> 24
        value = (ms << 80) | ((_counter & ((1 << 40) - 1)) << 40) | int.from_bytes(os.urandom(5), "big")
    # Two digits (10 bits) at a time: a digit at a time cost a client a sixth of its time per request.
    return "".join([_DIGIT_PAIRS[(value >> shift) & 1023] for shift in _PAIR_SHIFTS])


def request_id_value(request_id: str) -> int | None:
    """A ULID request id as its 128-bit number: ordered by time, then (ids of one client process, which
    ``new_request_id`` keeps monotonic) by issue; None for any other id."""
    if len(request_id) != 26:
        return None
    value = 0
    for ch in request_id.upper():
        digit = _CROCKFORD.find(ch)
        if digit < 0:
            return None
        value = value * 32 + digit
    return value


def request_id_ms(request_id: str) -> int | None:
    """The millisecond timestamp of a ULID request id (``new_request_id``); None for any other id."""
    value = request_id_value(request_id)
    return None if value is None else value >> 80


def utcnow() -> datetime:
    return datetime.now(UTC)


class ReplyTo(BaseModel):
    """Where the result goes: a topic and the client's partition (and key, for tools that look at keys)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    topic: str = Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")
    key: str = Field(max_length=1024)
    partition: int | None = Field(None, ge=0, le=100_000, description="Explicit partition; None = hash of key.")


class ClaimCheck(BaseModel):
    """A payload too large for a Kafka message, stored content-addressed in the blob store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    size: int = Field(ge=0)
    encoding: Literal["json+zstd"] = "json+zstd"


class RequestEnvelope(BaseModel):
    """A job request. ``payload`` is validated against the stage's request model by the runtime."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(default_factory=new_request_id, min_length=1, max_length=64)
    kind: str = Field(min_length=1, max_length=64, description="Stage name, e.g. 'echo'.")
    schema_version: int = Field(SCHEMA_VERSION, ge=SCHEMA_VERSION, le=SCHEMA_VERSION,
                                description="Major version of the envelope; a reader refuses others.")
    created_at: AwareDatetime = Field(default_factory=utcnow)
    deadline: AwareDatetime | None = Field(None, description="Absolute; a job not started by then is answered "
                                                             "'expired' and never run.")
    attempt: int = Field(0, ge=0, le=MAX_ATTEMPT)
    client_id: str = Field("anonymous", min_length=1, max_length=128)
    reply_to: ReplyTo | None = None
    payload: dict[str, Any] | None = None
    claim_check: ClaimCheck | None = Field(None, description="Set instead of payload when it is large.")
    lane: str | None = Field(None, min_length=1, max_length=32, pattern=r"^[a-z0-9_.-]+$",
                             description="The job's class for slot budgets (a worker's KILN_LANES): e.g. 'long'. "
                                         "Also sent as the record header kiln-lane, which workers schedule by.")
    redriven_from: str | None = Field(None, min_length=1, max_length=64,
                                      description="Request id of the dead-lettered request this one re-drives "
                                                  "(``kiln dlq redrive``); echoed on the result.")

    @model_validator(mode="after")
    def _plausible_times(self) -> RequestEnvelope:
        if self.created_at > utcnow() + CLOCK_SKEW:
            raise ValueError(f"created_at {self.created_at.isoformat()} is in the future")
        if self.deadline is not None and self.deadline > self.created_at + MAX_DEADLINE:
            raise ValueError(f"deadline more than {MAX_DEADLINE.days} days after created_at")
        return self

    def expired(self, now: datetime | None = None) -> bool:
        return self.deadline is not None and (now or utcnow()) >= self.deadline

    def with_deadline(self, seconds: float | None) -> RequestEnvelope:
        if seconds is None:
            return self
        return self.model_copy(update={"deadline": self.created_at + timedelta(seconds=seconds)})


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    message: str
    retryable: bool = False


ResultStatus = Literal["ok", "error", "expired"]


class ResultEnvelope(BaseModel):
    """A job's outcome, keyed by the request id so duplicates from a replayed job can be dropped."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    kind: str
    schema_version: int = SCHEMA_VERSION
    client_id: str
    status: ResultStatus
    result: dict[str, Any] | None = None
    claim_check: ClaimCheck | None = None
    error: ErrorInfo | None = None
    attempts: int = 1
    worker: str = ""
    started_at: datetime | None = None
    finished_at: datetime = Field(default_factory=utcnow)
    redriven_from: str | None = None
