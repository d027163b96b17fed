"""Reading kiln's records for people: what a record on any kiln topic is (request, result, dead letter,
heartbeat, stage numbers, task health, other), its ids for filtering, and a one-line summary."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Message
from pydantic import BaseModel, ValidationError

from kiln.schemas.envelope import RequestEnvelope, ResultEnvelope
from kiln.schemas.ops import StageStats, WorkerHeartbeat
from kiln.schemas.tasks import TaskHealth

DLQ_HEADER = "kiln-error-type"


def headers_of(msg: Message) -> list[tuple[str, str]]:
    raw = msg.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(k, v.decode(errors="replace") if isinstance(v, bytes) else str(v or "")) for k, v in pairs]


@dataclass
class Record:
    """One record, decoded as far as it goes."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: str | None
    headers: list[tuple[str, str]]
    type: str
    """request | result | dead-letter | heartbeat | tombstone | stats | task-health | json | bytes"""
    value: bytes | None = None
    model: BaseModel | None = None
    body: Any = None
    fields: dict[str, str] = field(default_factory=dict)
    """kind, client, request_id (and reason for a dead letter), where known: what tail filters on."""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def summary(self) -> str:
        f = self.fields
        if self.type == "request":
            extra = f" redriven_from={f['redriven_from']}" if f.get("redriven_from") else ""
            return f"request {f['request_id']} kind={f['kind']} client={f['client']} attempt={f['attempt']}{extra}"
        if self.type == "result":
            assert isinstance(self.model, ResultEnvelope)
            error = f" {self.model.error.type}: {self.model.error.message[:120]}" if self.model.error else ""
            return (f"result {f['request_id']} kind={f['kind']} client={f['client']} status={self.model.status} "
                    f"worker={self.model.worker}{error}")
        if self.type == "dead-letter":
            ids = f" {f['request_id']} kind={f['kind']} client={f['client']}" if "request_id" in f else " (malformed)"
            return (f"dead letter{ids} reason={f['reason']} attempts={self.header('kiln-attempts')}: "
                    f"{(self.header('kiln-error-message') or '')[:120]}")
        if self.type == "heartbeat":
            assert isinstance(self.model, WorkerHeartbeat)
            b = self.model
            return f"heartbeat {b.worker} stage={b.stage} {b.state} busy {b.busy}/{b.slots}"
        if self.type == "stats":
            assert isinstance(self.model, StageStats)
            s = self.model
            return (f"stats {s.stage} queue={s.queue_length} done/min={s.completions_per_min:.1f} "
                    f"workers={s.workers_now} busy {s.busy_now}/{s.slots_now}")
        if self.type == "task-health":
            assert isinstance(self.model, TaskHealth)
            t = self.model
            return (f"task-health {t.task_id} {t.status}{f' reason={t.reason}' if t.reason else ''} gold runs passed "
                    f"{t.gold_passed_runs}/{t.runs} kiln failures={t.infra_failures}")
        if self.type == "tombstone":
            return f"tombstone key={self.key}"
        text = json.dumps(self.body) if self.type == "json" else repr(self.body)
        return f"{self.type} {text[:200]}"

    def as_json(self) -> dict[str, Any]:
        body = self.model.model_dump(mode="json") if self.model is not None else self.body
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset,
                "timestamp_ms": self.timestamp_ms, "key": self.key, "type": self.type, "headers": self.headers,
                "value": body if self.type != "bytes" else repr(body)}


def _envelope_fields(envelope: RequestEnvelope | ResultEnvelope) -> dict[str, str]:
    found = {"request_id": envelope.request_id, "kind": envelope.kind, "client": envelope.client_id}
    if envelope.redriven_from:
        found["redriven_from"] = envelope.redriven_from
    if isinstance(envelope, RequestEnvelope):
        found["attempt"] = str(envelope.attempt)
    return found


def decode(msg: Message) -> Record:
    key = msg.key()
    _kind, timestamp = msg.timestamp()
    record = Record(topic=msg.topic() or "", partition=msg.partition() or 0, offset=msg.offset() or 0,
                    timestamp_ms=timestamp, key=key.decode(errors="replace") if isinstance(key, bytes) else key,
                    headers=headers_of(msg), type="bytes", value=msg.value())
    value = record.value
    if value is None:
        record.type = "tombstone"
        return record
    dead = record.header(DLQ_HEADER)
    for model, name in ((RequestEnvelope, "request"), (ResultEnvelope, "result"), (WorkerHeartbeat, "heartbeat"),
                        (StageStats, "stats"), (TaskHealth, "task-health")):
        try:
            record.model = model.model_validate_json(value)
        except ValidationError:
            continue
        record.type = name
        if isinstance(record.model, RequestEnvelope | ResultEnvelope):
            record.fields = _envelope_fields(record.model)
        break
    if record.model is None:
        try:
            record.body, record.type = json.loads(value), "json"
        except ValueError:
            record.body = value[:1000]
    if dead is not None:
        record.type = "dead-letter"
        record.fields["reason"] = dead
        record.fields.setdefault("kind", record.header("kiln-stage") or "")
    return record
