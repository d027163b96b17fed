"""Re-scoring by replay: the verify requests a topic still holds, checked again by the verifiers installed here, their
new verdicts published to ``verify.rescored`` next to those they were answered with, and a report of what changed.

Requests are read outside any consumer group (nothing is committed, live workers are untouched), decoded as the stage
decodes them (claim checks fetched from the blob store), and re-checked in this process through the stage's own code
(``kiln.workers.verify.stage.verified``): the verifiers are those installed where the command runs — the fixed
ones, deployed or not — while the checks they delegate (an exec checker, a Lean job) still go to the stages' workers.
The old verdicts come from the results topic, by request id; a request whose result is no longer kept is re-scored
and counted apart (``without_before``). A request re-produced for a retry (same id) is re-scored once.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from confluent_kafka import Consumer, Message, TopicPartition
from pydantic import BaseModel, Field

from kiln.schemas.verify import CompletionVerdict, RescoredRequest, VerifyRequest, VerifyResult
from kiln.streams import codec
from kiln.streams.blobstore import BlobStore, open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.errors import BlobCorrupt, BlobNotFound, ConfigError, MalformedRequest
from kiln.streams.offsets import coordinates
from kiln.streams.producer import publish_records
from kiln.streams.replay import read_topic, records_until_end
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import RESULTS_TOPIC
from kiln.workers.verifiers import VerifierContext, Verifiers
from kiln.workers.verify.spec import RESCORED_TOPIC, verify
from kiln.workers.verify.stage import verified


@dataclass
class Stored:
    request_id: str
    partition: int
    offset: int
    request: VerifyRequest


class Transition(BaseModel):
    verifier: str
    old_version: str = Field(description="empty: the stored verdict carried none")
    new_version: str
    before: str = Field(description="reward, or the failure kind")
    after: str
    completions: int


class RescoreReport(BaseModel):
    topic: str
    requests: int = 0
    completions: int = 0
    changed: int = 0
    without_before: int = Field(0, description="requests whose stored result is no longer kept (not compared)")
    malformed: int = Field(0, description="records that are not readable verify requests (or whose claim-check "
                                          "blob is gone)")
    past_retention: int = Field(0, description="offsets of the asked range the topic no longer holds")
    published: int = 0
    transitions: list[Transition] = Field(default_factory=list, description="changed verdicts, by verifier version "
                                                                            "and outcome")
    versions: dict[str, int] = Field(default_factory=dict, description="completions re-scored per "
                                                                       "'verifier old -> new' version")


def outcome(verdict: CompletionVerdict) -> str:
    """What a trainer gets from a verdict: its reward, or its failure kind."""
    return f"failure:{verdict.failure}" if verdict.failure else f"{verdict.reward:g}"


def _ms(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp() * 1000)


def stored_requests(settings: KilnSettings, *, since: datetime | None = None, until: datetime | None = None,
                    from_offset: int | None = None, to_offset: int | None = None,
                    blob_store: BlobStore | None = None) -> tuple[list[Stored], RescoreReport]:
    """The verify requests of ``verify.requests`` in the range (broker time ``since``..``until``, and/or offsets
    ``from_offset``..``to_offset`` inclusive, on every partition), decoded; a report with what could not be read."""
    name = settings.topic(verify.request_topic)
    report = RescoreReport(topic=name)
    consumer = Consumer(settings.kafka(**{"group.id": f"kiln-rescore-{os.getpid()}", "enable.auto.commit": False,
                                          "enable.partition.eof": True, "auto.offset.reset": "earliest"}))
    try:
        md = consumer.list_topics(name, timeout=15).topics.get(name)
        if md is None or md.error is not None:
            raise ConfigError(f"topic {name} does not exist")
        starts: dict[int, int] = {}
        ends: dict[int, int] = {}
        since_ms, until_ms = _ms(since), _ms(until)
        for p in md.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=15)
            start = low
            if from_offset is not None:
                report.past_retention += max(0, low - from_offset)
                start = max(low, from_offset)
            if since_ms is not None:
                [found] = consumer.offsets_for_times([TopicPartition(name, p, since_ms)], timeout=15)
                start = max(start, found.offset if found.offset >= 0 else high)
            end = high if to_offset is None else min(high, to_offset + 1)
            if end > start:
                starts[p], ends[p] = start, end
        consumer.assign([TopicPartition(name, p, o) for p, o in starts.items()])
        records: list[Message] = []
        while ends:
            records.extend(records_until_end(consumer, ends, until_ms=until_ms))
    finally:
        consumer.close()
    stored: dict[str, Stored] = {}
    for msg in records:
        _, p, offset = coordinates(msg)
        try:
            envelope = codec.decode_request(msg.value())
            if envelope.claim_check is not None and blob_store is None:
                blob_store = open_blob_store(settings)
            request = codec.request_payload(envelope, VerifyRequest, blob_store)
        except (MalformedRequest, BlobNotFound, BlobCorrupt):  # a blob store unreachable now: raised, not counted
            report.malformed += 1
            continue
        assert isinstance(request, VerifyRequest)
        stored.setdefault(envelope.request_id, Stored(envelope.request_id, p, offset, request))
    return list(stored.values()), report


def stored_results(settings: KilnSettings, request_ids: set[str],
                   blob_store: BlobStore | None = None) -> dict[str, VerifyResult]:
    """The verify results the results topic still holds for ``request_ids`` (the last ``ok`` one of each)."""
    found: dict[str, VerifyResult] = {}
    for msg in read_topic(settings, RESULTS_TOPIC):
        value = msg.value()
        if not value or codec.result_request_id(value, msg.headers()) not in request_ids:
            continue
        envelope = codec.decode_result(value)
        if envelope.kind != verify.kind or envelope.status != "ok":
            continue
        if envelope.claim_check is not None and blob_store is None:
            blob_store = open_blob_store(settings)
        body = codec.result_body(envelope, blob_store)
        if body is not None:
            found[envelope.request_id] = VerifyResult.model_validate(body)
    return found


def compare(before: VerifyResult | None, after: VerifyResult) -> list[int]:
    """Indices of the completions whose outcome (reward, or failure kind) differs."""
    if before is None:
        return []
    if len(before.verdicts) != len(after.verdicts):
        return list(range(len(after.verdicts)))
    return [i for i, (b, a) in enumerate(zip(before.verdicts, after.verdicts, strict=True)) if outcome(b) != outcome(a)]


async def rescore(settings: KilnSettings, *, since: datetime | None = None, until: datetime | None = None,
                  from_offset: int | None = None, to_offset: int | None = None, concurrency: int = 16,
                  publish: bool = True, blob_store: BlobStore | None = None) -> RescoreReport:
    """Re-score the stored verify requests of the range with the verifiers installed here; publish each request's new
    verdicts (with its old ones) to ``verify.rescored``; what changed, by verifier version."""
    stored, report = await asyncio.to_thread(stored_requests, settings, since=since, until=until,
                                             from_offset=from_offset, to_offset=to_offset, blob_store=blob_store)
    befores = await asyncio.to_thread(stored_results, settings, {s.request_id for s in stored}, blob_store)
    kiln = KilnClient(settings, f"verify-rescore.{socket.gethostname()}.{os.getpid()}")
    verifiers = Verifiers(VerifierContext(kiln, failures_as_verdicts=True))
    gate = asyncio.Semaphore(concurrency)

    async def one(s: Stored) -> RescoredRequest:
        async with gate:
            result = await verified(verifiers, s.request, s.request_id)
        before = befores.get(s.request_id)
        return RescoredRequest(request_id=s.request_id, topic=report.topic, partition=s.partition, offset=s.offset,
                               before=before, result=result, changed=compare(before, result))

    try:
        rescored = await asyncio.gather(*(one(s) for s in stored))
    finally:
        await verifiers.close()
    transitions: Counter[tuple[str, str, str, str, str]] = Counter()
    versions: Counter[str] = Counter()
    for r in rescored:
        report.requests += 1
        report.completions += len(r.result.verdicts)
        report.without_before += r.before is None
        report.changed += len(r.changed)
        for i, after in enumerate(r.result.verdicts):
            old = r.before.verdicts[i] if r.before is not None and i < len(r.before.verdicts) else None
            versions[f"{after.verifier} {old.version if old else '?'} -> {after.version}"] += 1
            if i in r.changed and old is not None:
                transitions[(after.verifier, old.version, after.version, outcome(old), outcome(after))] += 1
    report.transitions = [Transition(verifier=k[0], old_version=k[1], new_version=k[2], before=k[3], after=k[4],
                                     completions=n) for k, n in sorted(transitions.items())]
    report.versions = dict(sorted(versions.items()))
    if publish and rescored:
        await asyncio.to_thread(publish_records, settings, RESCORED_TOPIC, [(r.request_id, r) for r in rescored],
                                f"verify-rescore-{os.getpid()}")
        report.published = len(rescored)
    return report
