"""Runs one job end to end, whatever delivered it: decode, the middleware chain, the handler, the result to the
request's ``reply_to``, and the dead-letter record on terminal failure.

Both consumption modes use it: consumer groups (``streams.runtime``) and share groups (``streams.share``), so a
stage's handler and the client are the same in either.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Message
from pydantic import ValidationError

from kiln.schemas.envelope import ErrorInfo, ReplyTo, RequestEnvelope, ResultEnvelope
from kiln.streams import codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.deadletter import DeadLetterWriter
from kiln.streams.errors import BlobError, KilnError, MalformedRequest
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.middleware import Job, Middleware, Outcome, default_middleware, error_info, stage_chain
from kiln.streams.offsets import coordinates
from kiln.streams.producer import WorkerProducer
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import JobContext, Stage, stage_specs

log = logging.getLogger("kiln.executor")


def job_expiry(envelope: RequestEnvelope, msg: Message) -> float | None:
    """When the request's time budget (deadline minus ``created_at``: one clock, the client's) runs out, counted from
    the broker's timestamp of the record; None without a deadline or a broker timestamp (a topic with CreateTime),
    where the envelope's absolute deadline decides."""
    if envelope.deadline is None:
        return None
    kind, ms = msg.timestamp()
    if kind != TIMESTAMP_LOG_APPEND_TIME or ms <= 0:
        return None
    return ms / 1000 + (envelope.deadline - envelope.created_at).total_seconds()


def new_worker_id() -> str:
    """Unique per process and start: host, pid and a random suffix (a restarted pid is another worker)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class JobExecutor:
    """Runs jobs on the loop; owns the worker's producer (``streams.producer``) and dead-letter writer
    (``streams.deadletter``)."""

    def __init__(self, stage: Stage, settings: KilnSettings, metrics: WorkerMetrics, worker_id: str,
                 dlq_topic: str, blob_store: BlobStore | None = None,
                 middleware: Sequence[Middleware] | None = None) -> None:
        self.stage = stage
        self.settings = settings
        self.metrics = metrics
        self.worker_id = worker_id
        self.dlq_topic = dlq_topic
        self.blob_store = blob_store
        policies = middleware or default_middleware(metrics, settings.job_timeout_s)
        self._chain = stage_chain(stage, policies, blob_store)
        self.producer = WorkerProducer(settings, metrics, worker_id)
        self.dead_letters = DeadLetterWriter(self.producer, metrics, stage.name, worker_id, dlq_topic, blob_store)
        own = dlq_topic.removesuffix(".dlq")
        requests = {own, *(settings.topic(spec.request_topic) for spec in stage_specs().values())}
        self.request_topics = frozenset(requests | {f"{t}.dlq" for t in requests})
        """Topics a reply must never go to: it would come back as a request (or land among dead letters)."""

    async def start(self, loop: asyncio.AbstractEventLoop, slots: int) -> None:
        """Start the producer, then the stage's own setup (sized to the worker's ``slots``)."""
        self.producer.start(loop)
        if self.stage.setup is not None:
            await self.stage.setup(slots)

    async def close(self) -> None:
        """The stage's teardown, then flush outstanding results and dead letters and stop the delivery thread."""
        if self.stage.teardown is not None:
            await self.stage.teardown()
        await self.producer.close()

    async def process(self, msg: Message, release_slot: Callable[[], None] = lambda: None) -> Outcome | None:
        """Run the job in ``msg``; returns its outcome (None for undecodable input, which is dead-lettered).

        ``release_slot`` is called once the handler is done, before its result is published. Whatever the record
        carries, it runs or is dead-lettered once with the reason; this raises nothing but ``CancelledError`` (a
        revoke or shutdown while the broker is away: the offset stays unfinished and the job replays).
        """
        started = datetime.now(UTC)
        try:
            envelope = self._decode(msg)
        except MalformedRequest as e:
            release_slot()
            await self._reject(msg, e)
            return None
        job = self._job(msg, envelope)
        return await self._complete(msg, envelope, started, await self._chain(job), release_slot)

    def _decode(self, msg: Message) -> RequestEnvelope:
        """The request in ``msg``, for this stage, with a reply address; else ``MalformedRequest``."""
        envelope = codec.decode_request(msg.value())
        if envelope.kind != self.stage.name:
            raise MalformedRequest(f"kind {envelope.kind!r} sent to stage {self.stage.name!r}")
        self._check_reply_address(envelope.reply_to)
        return envelope

    def _job(self, msg: Message, envelope: RequestEnvelope) -> Job:
        topic, partition, offset = coordinates(msg)
        raw_key = msg.key()
        ctx = JobContext(envelope=envelope, attempt=0, worker_id=self.worker_id, topic=topic,
                         partition=partition, offset=offset,
                         key=raw_key.decode(errors="replace") if raw_key is not None else None,
                         expires_at=job_expiry(envelope, msg))
        return Job(self.stage, ctx)

    async def _reject(self, msg: Message, e: MalformedRequest) -> None:
        await self.dead_letters.write(msg, error_info(e, False), attempts=0)
        await self.reply_error(msg, error_info(e, False))

    async def _complete(self, msg: Message, envelope: RequestEnvelope, started: datetime, outcome: Outcome,
                        release_slot: Callable[[], None]) -> Outcome:
        """The job from its outcome on: the slot released, the dead letter, the reply and the event."""
        release_slot()
        dead_lettered = outcome.dead_letter and outcome.error is not None
        if dead_lettered and outcome.error is not None:
            await self.dead_letters.write(msg, outcome.error, outcome.attempts)
        try:
            await self._reply_retrying(envelope, outcome, started)
            await self.producer.retrying("event", lambda: self._publish_event(msg, outcome))
        except KilnError as e:
            # An unreachable reply_to (a topic that does not exist) or a blob store that stayed down: record it
            # (once: a job already dead-lettered keeps its first reason), and tell the client (a small error result
            # needs no claim check) rather than let it wait.
            error = ErrorInfo(type=type(e).__name__ if isinstance(e, BlobError) else "ReplyDeliveryFailed",
                              message=str(e)[:2000])
            if dead_lettered:
                log.warning("request %s: dead-lettered, and its error result was not delivered: %s",
                            envelope.request_id, e)
            else:
                await self.dead_letters.write(msg, error, outcome.attempts)
            await self.reply_error(msg, error)
        return outcome

    def _check_reply_address(self, reply_to: ReplyTo | None) -> None:
        """A request must say where its result goes, and not to a request topic (the result would loop back as a
        request)."""
        if reply_to is None:
            raise MalformedRequest("no reply_to: nobody would learn the outcome")
        if reply_to.topic in self.request_topics:
            raise MalformedRequest(f"reply_to {reply_to.topic!r} is a request topic")

    async def _reply_retrying(self, envelope: RequestEnvelope, outcome: Outcome, started: datetime) -> None:
        """The reply, retried with backoff while the broker or the blob store (a large result's claim check) is
        unavailable, or while its topic, gone a moment ago, is being re-created."""
        await self.producer.retrying("reply", lambda: self._reply(envelope, outcome, started))

    def _result_value(self, envelope: RequestEnvelope, outcome: Outcome, started: datetime) -> bytes:
        return codec.result_json(envelope, outcome.status, outcome.result, outcome.error, outcome.attempts,
                                 self.worker_id, started, datetime.now(UTC))

    async def _reply(self, envelope: RequestEnvelope, outcome: Outcome, started: datetime) -> None:
        if envelope.reply_to is None:
            return
        value = self._result_value(envelope, outcome, started)
        if len(value) > self.settings.claim_check_bytes and self.blob_store is not None:
            # A claim check is blob-store I/O: off the event loop (a small result skips the thread hop).
            result = codec.decode_result(value)
            value = await asyncio.to_thread(codec.encode, result, self.blob_store, self.settings.claim_check_bytes)
        if not self.producer.destination_known(envelope.reply_to.topic, envelope.reply_to.partition):
            await self.producer.check_destination(envelope.reply_to.topic, envelope.reply_to.partition)
        await self.producer.produce(envelope.reply_to.topic, value, key=envelope.reply_to.key,
                           partition=envelope.reply_to.partition, headers=codec.result_headers(envelope.request_id))

    async def _publish_event(self, msg: Message, outcome: Outcome) -> None:
        topic = self.stage.spec.events_topic
        if topic is None or outcome.status != "ok" or outcome.result is None:
            return
        await self.producer.produce(self.settings.topic(topic), outcome.result.model_dump_json().encode(),
                                    key=msg.key())

    async def reply_error(self, msg: Message, error: ErrorInfo) -> None:
        """Best effort: if the raw request names its id and a valid reply_to that is no request topic, tell the
        client rather than let it wait (also for malformed requests). Never raises but ``CancelledError``."""
        try:
            raw = json.loads(msg.value() or b"")
            reply_to = ReplyTo.model_validate(raw["reply_to"])
            request_id = raw["request_id"]
            if not isinstance(request_id, str) or reply_to.topic in self.request_topics:
                return
            result = ResultEnvelope(request_id=request_id[:64], kind=str(raw.get("kind", self.stage.name))[:64],
                                    client_id=str(raw.get("client_id", "anonymous"))[:128], status="error",
                                    error=error, attempts=0, worker=self.worker_id)
        except (ValueError, TypeError, KeyError, ValidationError):
            return
        value = result.model_dump_json().encode()

        async def send() -> None:
            await self.producer.check_destination(reply_to.topic, reply_to.partition)
            await self.producer.produce(reply_to.topic, value, key=reply_to.key, partition=reply_to.partition,
                               headers=codec.result_headers(result.request_id))

        try:
            await self.producer.retrying("error reply", send, best_effort=True)
        except KilnError as e:
            log.info("error result for request %s not delivered: %s", result.request_id, e)
