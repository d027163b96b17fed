"""Dead letters for operators: list them by reason, show one, re-drive selected ones to their source topic.

A re-drive sends the original request again under a new request id that names the original (``redriven_from``), with
the same client id and reply address, so the owning client receives the result through ``unclaimed()``; the attempt
count starts again. Each re-driven dead letter gets a marker on the compacted ``kiln.redrives`` topic, written in the
same Kafka transaction as the request: a second re-drive of the same records skips them, and a re-drive that dies
half-way re-sent nothing (its transaction is aborted when the next one starts under the same transactional id).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from confluent_kafka import Producer

from kiln.schemas.envelope import RequestEnvelope, utcnow
from kiln.streams.blobstore import BlobStore
from kiln.streams.codec import decode_request
from kiln.streams.errors import ConfigError, MalformedRequest
from kiln.streams.replay import read_topic
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import REDRIVES_TOPIC, stage_specs
from kiln.streams.status.records import Record, decode

SOURCE_HEADER = "kiln-source-topic"


def dlq_topics(settings: KilnSettings, stages: list[str] | None = None) -> list[str]:
    """The dead-letter topics (unprefixed) of the named stages, or of every registered stage."""
    specs = stage_specs()
    unknown = sorted(set(stages or []) - set(specs))
    if unknown:
        raise ConfigError(f"no stage named {', '.join(unknown)}; installed: {', '.join(sorted(specs))}")
    return [f"{spec.request_topic}.dlq" for kind, spec in sorted(specs.items()) if not stages or kind in stages]


def dead_letters(settings: KilnSettings, topic: str) -> list[Record]:
    """Every record the dead-letter topic (unprefixed) holds now; none when it does not exist."""
    try:
        return [decode(m) for m in read_topic(settings, topic)]
    except ConfigError:
        return []


def marker_key(record: Record) -> str:
    return f"{record.topic}/{record.partition}/{record.offset}"


def redriven(settings: KilnSettings) -> dict[str, dict[str, str]]:
    """Markers of dead letters re-driven so far, by ``topic/partition/offset`` (committed transactions only)."""
    markers: dict[str, dict[str, str]] = {}
    try:
        messages = read_topic(settings, REDRIVES_TOPIC)
    except ConfigError:
        return markers
    for m in messages:
        if m.value() is not None:
            markers[(m.key() or b"").decode()] = json.loads(m.value() or b"{}")
    return markers


@dataclass
class Redrive:
    """What happened to one selected dead letter."""

    dead_letter: str
    """``topic/partition/offset``"""
    original: str | None
    request_id: str | None = None
    skipped: str | None = None


def new_request_id(record: Record) -> str:
    """Derived from the dead letter's position: the same record always re-drives under the same id."""
    return "redrive-" + hashlib.sha256(marker_key(record).encode()).hexdigest()[:32]


def _request(record: Record, store: BlobStore | None) -> RequestEnvelope:
    raw = record.value
    check = record.header("kiln-dlq-claim-check")
    if check is not None:
        if store is None:
            raise MalformedRequest("its request is in the blob store and no store is configured")
        raw = store.get(check)
    elif record.header("kiln-dlq-truncated") == "true":
        raise MalformedRequest("its request was truncated when dead-lettered (no blob store then)")
    return decode_request(raw)


def redrive(settings: KilnSettings, topic: str, records: list[Record], store: BlobStore | None = None) -> list[Redrive]:
    """Re-drive ``records`` (dead letters of ``topic``, unprefixed) in one transaction. Already re-driven ones and
    ones that are not requests are skipped, with the reason."""
    producer = Producer(settings.kafka(**{"transactional.id": settings.topic("kiln-dlq-redrive"),
                                          "enable.idempotence": True, "acks": "all"}))
    # Fences an earlier redrive still holding the transactional id: its unfinished transaction is aborted before
    # the markers are read, so what is read is final.
    producer.init_transactions(30)
    done = redriven(settings)
    outcomes: list[Redrive] = []
    producer.begin_transaction()
    try:
        for record in records:
            key = marker_key(record)
            outcome = Redrive(key, record.fields.get("request_id"))
            outcomes.append(outcome)
            if key in done:
                outcome.skipped = f"already re-driven as {done[key]['request_id']}"
                continue
            try:
                envelope = _request(record, store)
            except MalformedRequest as e:
                outcome.skipped = f"not a request: {e}"
                continue
            outcome.original = envelope.request_id
            source = record.header(SOURCE_HEADER) or settings.topic(topic.removesuffix(".dlq"))
            lifetime = envelope.deadline - envelope.created_at if envelope.deadline else None
            now = utcnow()
            again = envelope.model_copy(update={
                "request_id": new_request_id(record), "attempt": 0, "redriven_from": envelope.request_id,
                "created_at": now, "deadline": now + lifetime if lifetime else None})
            passed: list[tuple[str, str | bytes | None]] = [
                (k, v) for k, v in record.headers if not k.startswith("kiln-")]
            producer.produce(source, again.model_dump_json(exclude_none=True).encode(),
                             key=record.key.encode() if record.key is not None else None, headers=passed)
            outcome.request_id = again.request_id
            producer.produce(settings.topic(REDRIVES_TOPIC), json.dumps({
                "request_id": again.request_id, "redriven_from": envelope.request_id, "source_topic": source,
                "at": time.time()}).encode(), key=key.encode())
        producer.commit_transaction(60)
    except BaseException:
        producer.abort_transaction(30)
        raise
    return outcomes


def select(records: list[Record], *, offsets: list[int] | None = None, reasons: list[str] | None = None,
           request_ids: list[str] | None = None) -> list[Record]:
    """The dead letters matching every given criterion (offsets, reasons, original request ids)."""
    return [r for r in records
            if (not offsets or r.offset in offsets) and (not reasons or r.fields.get("reason") in reasons)
            and (not request_ids or r.fields.get("request_id") in request_ids)]
