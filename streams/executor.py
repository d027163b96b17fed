"""Runs one job end to end, whatever delivered it: decode, the middleware chain, the handler, the result to the
request's ``reply_to``, and the dead-letter record on terminal failure.

Both consumption modes use it: consumer groups (``streams.runtime``) and share groups (``streams.share``), so a
stage's handler and the client are the same in either.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaError, KafkaException, Message, Producer
from pydantic import ValidationError

from kiln.schemas.envelope import ErrorInfo, ReplyTo, RequestEnvelope, ResultEnvelope
from kiln.streams import codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import (
    BlobError,
    BlobUnavailable,
    BrokerUnavailable,
    DeliveryRefused,
    KilnError,
    MalformedRequest,
)
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.middleware import (
    Job,
    Middleware,
    Outcome,
    default_middleware,
    error_info,
    stage_chain,
)
from kiln.streams.offsets import coordinates
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import JobContext, Stage, stage_specs

log = logging.getLogger("kiln.executor")
REPLY_ATTEMPTS = 4
DLQ_VALUE_LIMIT = 900_000
"""Largest request value copied into a dead letter as is (the producer refuses ~1 MB; key and headers need room):
above it the dead letter carries a claim check (or, without a blob store, a truncated copy) and the source
coordinates."""
DLQ_KEY_LIMIT = 4096
"""Largest request key copied into a dead letter as is; a longer one is cut to this, its size recorded
(``kiln-dlq-original-key-bytes``) and the whole key claim-checked (``kiln-dlq-key-claim-check``)."""
DLQ_HEADERS_LIMIT = 32 * 1024
"""Most bytes of the request's own headers (names and values) copied into a dead letter: past it they are cut, their
total size and count recorded (``kiln-dlq-original-headers-bytes``, ``-count``) and all of them claim-checked as
JSON ``[[name, base64 value], ...]`` (``kiln-dlq-headers-claim-check``). Key, headers and value together stay
under the producer's 1 MB."""
_HEADER_NAME_LIMIT = 256
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 15.0
REAPPEAR_S = 60.0
"""How long a reply topic this worker saw and then saw vanish (deleted, being re-created) is waited for before its
reply is given up as undeliverable."""
MISSING_GRACE_S = 10.0
"""How long a reply topic this worker never saw is waited for: it may be in the middle of a re-creation that this
worker (say, one started a moment ago) never saw begin; a name that never existed costs its job this wait."""
_UNAVAILABLE = {
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._MSG_TIMED_OUT, KafkaError._ALL_BROKERS_DOWN,
    KafkaError._RESOLVE, KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION, KafkaError.BROKER_NOT_AVAILABLE,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, KafkaError.KAFKA_STORAGE_ERROR,
}
_NO_DESTINATION = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION}


class _NoDestination(DeliveryRefused):
    """The topic (or partition) is not there: for good, unless it existed a moment ago (being re-created)."""

    def __init__(self, message: str, topic: str) -> None:
        super().__init__(message)
        self.topic = topic


def _shown(topic: str) -> str:
    return repr(topic if len(topic) <= 100 else f"{topic[:100]}... ({len(topic)} characters)")


def delivery_error(error: BaseException | KafkaError, topic: str) -> KilnError:
    """What a failed produce, delivery report or metadata lookup for ``topic`` means: ``BrokerUnavailable`` (retry
    later), ``DeliveryRefused`` (this record can never go there; ``_NoDestination`` when the topic or partition
    does not exist). librdkafka raises
    ``KafkaException``, but also ``ValueError`` (a NUL byte in a name) and ``RuntimeError`` (a name it cannot make
    a topic of, e.g. 600 characters); anything that is no Kafka error refuses the record."""
    if isinstance(error, KafkaException) and error.args and isinstance(error.args[0], KafkaError):
        error = error.args[0]
    if isinstance(error, KafkaError):
        if error.code() in _NO_DESTINATION:
            return _NoDestination(f"delivery to {_shown(topic)} refused: {error.str()}", topic)
        if error.code() in _UNAVAILABLE or error.retriable():
            return BrokerUnavailable(f"delivery to {_shown(topic)}: {error.str()}")
        return DeliveryRefused(f"delivery to {_shown(topic)} refused: {error.str()}")
    if isinstance(error, KilnError):
        return error
    return DeliveryRefused(f"delivery to {_shown(topic)} refused: {type(error).__name__}: {str(error)[:300]}")


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


def _backoff(delay: float) -> float:
    return min(RETRY_MAX_S, delay * 2)


def new_worker_id() -> str:
    """Unique per process and start: host, pid and a random suffix (a restarted pid is another worker)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def producer_config(settings: KilnSettings, **extra: Any) -> dict[str, Any]:
    """Idempotent producer: retries never duplicate or reorder a partition's records."""
    return settings.kafka(**{"enable.idempotence": True, "acks": "all", "linger.ms": 2, "compression.type": "zstd",
                             "message.timeout.ms": 120000, **extra})


def _settle(batch: list[tuple[asyncio.Future[None], KilnError | None]]) -> None:
    for done, error in batch:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)


class JobExecutor:
    """Owns the worker's producer (and the thread serving its delivery reports) and runs jobs on the loop."""

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
        self._producer: Producer | None = None
        self._topic_partitions: dict[str, int] = {}  # reply topics seen to exist, with their partition counts
        self._vanished: dict[str, float] = {}  # reply topics found missing, waited for: since when (monotonic)
        self._seen: set[str] = set()  # reply topics this worker has seen exist (a vanished one is waited for longer)
        own = dlq_topic.removesuffix(".dlq")
        requests = {own, *(settings.topic(spec.request_topic) for spec in stage_specs().values())}
        self.request_topics = frozenset(requests | {f"{t}.dlq" for t in requests})
        """Topics a reply must never go to: it would come back as a request (or land among dead letters)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = threading.Event()
        self._delivery_thread: threading.Thread | None = None
        # Delivery reports, filled by librdkafka callbacks in whichever thread polls, handed to the loop in batches:
        # one wake-up of the loop per poll, not one per record.
        self._settled: collections.deque[tuple[asyncio.Future[None], KilnError | None]] = collections.deque()

    async def start(self, loop: asyncio.AbstractEventLoop, slots: int) -> None:
        """Start the producer, then the stage's own setup (sized to the worker's ``slots``)."""
        self._loop = loop
        self._producer = Producer(producer_config(self.settings, **{"client.id": self.worker_id}))
        self._delivery_thread = threading.Thread(target=self._delivery_main, name="kiln-delivery", daemon=True)
        self._delivery_thread.start()
        if self.stage.setup is not None:
            await self.stage.setup(slots)

    async def close(self) -> None:
        """The stage's teardown, then flush outstanding results and dead letters and stop the delivery thread."""
        if self.stage.teardown is not None:
            await self.stage.teardown()
        if self._producer is not None:
            await asyncio.to_thread(self._producer.flush, 10)
        self._closing.set()
        if self._delivery_thread is not None:
            await asyncio.to_thread(self._delivery_thread.join, 5)

    def _delivery_main(self) -> None:
        assert self._producer is not None and self._loop is not None
        while True:
            closing = self._closing.is_set() and len(self._producer) == 0
            self._producer.poll(0 if closing else 0.1)
            if self._settled:
                batch = [self._settled.popleft() for _ in range(len(self._settled))]
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits these any more
                    self._loop.call_soon_threadsafe(_settle, batch)
            if closing:
                return

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
        await self.dead_letter(msg, error_info(e, False), attempts=0)
        await self.reply_error(msg, error_info(e, False))

    async def _complete(self, msg: Message, envelope: RequestEnvelope, started: datetime, outcome: Outcome,
                        release_slot: Callable[[], None]) -> Outcome:
        """The job from its outcome on: the slot released, the dead letter, the reply and the event."""
        release_slot()
        dead_lettered = outcome.dead_letter and outcome.error is not None
        if dead_lettered and outcome.error is not None:
            await self.dead_letter(msg, outcome.error, outcome.attempts)
        try:
            await self._reply_retrying(envelope, outcome, started)
            await self._retrying("event", lambda: self._publish_event(msg, outcome))
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
                await self.dead_letter(msg, error, outcome.attempts)
            await self.reply_error(msg, error)
        return outcome

    def _check_reply_address(self, reply_to: ReplyTo | None) -> None:
        """A request must say where its result goes, and not to a request topic (the result would loop back as a
        request)."""
        if reply_to is None:
            raise MalformedRequest("no reply_to: nobody would learn the outcome")
        if reply_to.topic in self.request_topics:
            raise MalformedRequest(f"reply_to {reply_to.topic!r} is a request topic")

    async def _retrying(self, what: str, send: Callable[[], Awaitable[None]], blob_attempts: int = REPLY_ATTEMPTS,
                        best_effort: bool = False) -> None:
        """``send()``, classified: ``BrokerUnavailable`` is retried with backoff for as long as it lasts (the worker
        stays up; a revoke cancels the wait), a reply topic that is not there for up to ``REAPPEAR_S`` (seen
        before) or ``MISSING_GRACE_S`` (never seen), an unavailable blob store ``blob_attempts`` times;
        ``DeliveryRefused`` (and anything unexpected, as one) is raised. ``best_effort``: an outage is retried
        ``blob_attempts`` times too, then given up."""
        delay = RETRY_FIRST_S
        blob_failures = unavailable = 0
        while True:
            try:
                await send()
                return
            except BlobUnavailable:
                blob_failures += 1
                if blob_failures >= blob_attempts:
                    raise
            except BrokerUnavailable as e:
                unavailable += 1
                if best_effort and unavailable >= blob_attempts:
                    raise
                self.metrics.delivery_retried(what)
                log.warning("%s not delivered yet (retrying in about %.1f s): %s", what, delay, e)
            except _NoDestination as e:
                if best_effort and e.topic not in self._vanished:
                    raise  # an error reply waits only for a topic a reply is already waiting for
                since = self._vanished.setdefault(e.topic, time.monotonic())
                if time.monotonic() - since > (REAPPEAR_S if e.topic in self._seen else MISSING_GRACE_S):
                    self._vanished.pop(e.topic, None)
                    self._seen.discard(e.topic)
                    raise
                log.warning("%s: topic %s is not there; waiting for it to be (re-)created", what, _shown(e.topic))
            except (KilnError, asyncio.CancelledError):
                raise
            except Exception as e:
                raise DeliveryRefused(f"{what} failed: {type(e).__name__}: {str(e)[:300]}") from e
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = _backoff(delay)

    async def _reply_retrying(self, envelope: RequestEnvelope, outcome: Outcome, started: datetime) -> None:
        """The reply, retried with backoff while the broker or the blob store (a large result's claim check) is
        unavailable, or while its topic, gone a moment ago, is being re-created."""
        await self._retrying("reply", lambda: self._reply(envelope, outcome, started))

    async def produce(self, topic: str, value: bytes | None, key: bytes | str | None = None,
                      partition: int | None = None, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Produce one record and wait until the broker has it (acks=all). Every failure is classified
        (``delivery_error``): ``BrokerUnavailable`` or ``DeliveryRefused``."""
        assert self._producer is not None and self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        settled = self._settled

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            settled.append((done, None if err is None else delivery_error(err, topic)))

        kwargs: dict[str, Any] = {"key": key, "headers": headers, "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        try:
            while True:
                try:
                    self._producer.produce(topic, value, **kwargs)
                    break
                except BufferError:  # local queue full: let the delivery thread drain it
                    await asyncio.sleep(0.01)
                except Exception as e:  # refused locally: too large, an invalid name, unknown partition, ...
                    raise delivery_error(e, topic) from None
            await done
        except _NoDestination:
            if self._topic_partitions.pop(topic, None) is not None:
                self._vanished.setdefault(topic, time.monotonic())  # it existed: maybe being re-created
            raise

    async def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (0: it does not exist), asked once per topic; a lookup the broker does
        not answer raises ``BrokerUnavailable``, a name librdkafka refuses ``DeliveryRefused``."""
        assert self._producer is not None
        if topic not in self._topic_partitions:
            producer = self._producer
            try:
                md = await asyncio.to_thread(lambda: producer.list_topics(topic, timeout=10).topics.get(topic))
            except Exception as e:
                raise delivery_error(e, topic) from None
            if md is not None and md.error is not None and md.error.code() not in _NO_DESTINATION:
                raise delivery_error(md.error, topic)  # e.g. no leader yet, not authorized
            if md is None or md.error is not None or not md.partitions:
                return 0
            self._topic_partitions[topic] = len(md.partitions)
            self._vanished.pop(topic, None)
            self._seen.add(topic)
        return self._topic_partitions[topic]

    def _destination_known(self, topic: str, partition: int | None) -> bool:
        """Already seen to exist (no coroutine per reply for the common case)."""
        count = self._topic_partitions.get(topic, 0)
        return count > 0 and (partition is None or partition < count)

    async def _check_destination(self, topic: str, partition: int | None) -> None:
        """A reply's topic and partition exist (a request names them; a wrong one must fail fast, not after the
        producer's metadata timeout)."""
        count = await self.partitions(topic)
        if not count:
            raise _NoDestination(f"reply topic {_shown(topic)} does not exist", topic)
        if partition is not None and partition >= count:
            raise DeliveryRefused(f"reply topic {_shown(topic)} has no partition {partition}")

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
        if not self._destination_known(envelope.reply_to.topic, envelope.reply_to.partition):
            await self._check_destination(envelope.reply_to.topic, envelope.reply_to.partition)
        await self.produce(envelope.reply_to.topic, value, key=envelope.reply_to.key,
                           partition=envelope.reply_to.partition, headers=codec.result_headers(envelope.request_id))

    async def _publish_event(self, msg: Message, outcome: Outcome) -> None:
        topic = self.stage.spec.events_topic
        if topic is None or outcome.status != "ok" or outcome.result is None:
            return
        await self.produce(self.settings.topic(topic), outcome.result.model_dump_json().encode(), key=msg.key())

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
            await self._check_destination(reply_to.topic, reply_to.partition)
            await self.produce(reply_to.topic, value, key=reply_to.key, partition=reply_to.partition,
                               headers=codec.result_headers(result.request_id))

        try:
            await self._retrying("error reply", send, best_effort=True)
        except KilnError as e:
            log.info("error result for request %s not delivered: %s", result.request_id, e)

    async def dead_letter(self, msg: Message, error: ErrorInfo, attempts: int) -> None:
        """Write the dead letter of ``msg``: the reason and source coordinates in ``kiln-*`` headers, bounded copies of
        its key, headers and value (sizes recorded, the rest claim-checked). A record the broker refuses anyway is
        replaced by a minimal one (reason and coordinates only); an outage is retried with backoff. Never raises but
        ``CancelledError``."""
        meta = [
            ("kiln-error-type", error.type.encode()[:256]),
            ("kiln-error-message", error.message.encode()[:4000]),
            ("kiln-stage", self.stage.name.encode()),
            ("kiln-attempts", str(attempts).encode()),
            ("kiln-source-topic", str(msg.topic()).encode()),
            ("kiln-source-partition", str(msg.partition()).encode()),
            ("kiln-source-offset", str(msg.offset()).encode()),
            ("kiln-worker", self.worker_id.encode()),
        ]
        try:
            key, value, extra, original = await self._bounded_copies(msg)
        except Exception as e:  # nothing about the record may stop its dead letter: fall back to the minimal one
            log.exception("dead letter of %s[%s]@%s: copying the record failed", msg.topic(), msg.partition(),
                          msg.offset())
            key, value, extra, original = None, b"", [("kiln-dlq-refused", f"copy failed: {e!r}"[:1000].encode())], []
        headers = meta + extra + original
        delay = RETRY_FIRST_S
        minimal = False
        while True:
            try:
                await self.produce(self.dlq_topic, value, key=key, headers=headers)
                break
            except BrokerUnavailable as e:
                self.metrics.delivery_retried("dead letter")
                log.warning("dead letter not delivered yet (retrying in about %.1f s): %s", delay, e)
            except Exception as e:  # DeliveryRefused, or anything librdkafka raised that no class foresaw
                if not minimal:
                    log.warning("dead letter of %s[%s]@%s refused (%s): writing a minimal one", msg.topic(),
                                msg.partition(), msg.offset(), e)
                    minimal = True
                    key, value = None, b""
                    headers = [*meta, ("kiln-dlq-refused", str(e).encode()[:1000])]
                    continue
                # Not even reason and coordinates: the dead-letter topic is missing or not writable. A deployment
                # fault; the partition waits for it, the worker stays up.
                self.metrics.delivery_retried("dead letter")
                log.error("the dead-letter topic %s refuses records (retrying in about %.1f s): %s", self.dlq_topic,
                          delay, e)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = _backoff(delay)
        self.metrics.dead_lettered(error.type)

    async def _bounded_copies(self, msg: Message) -> tuple[bytes | None, bytes, list[tuple[str, bytes]],
                                                           list[tuple[str, bytes]]]:
        """Key, value, headers describing what was cut, and the request's own headers, each within its limit
        (``DLQ_KEY_LIMIT``, ``DLQ_VALUE_LIMIT``, ``DLQ_HEADERS_LIMIT``); what does not fit is claim-checked whole
        (or, without a blob store or while it is down, only cut, with its size recorded)."""
        extra: list[tuple[str, bytes]] = []
        key = msg.key()
        if key is not None and len(key) > DLQ_KEY_LIMIT:
            extra.append(("kiln-dlq-original-key-bytes", str(len(key)).encode()))
            await self._claim_check(extra, "kiln-dlq-key-claim-check", key)
            key = key[:DLQ_KEY_LIMIT]
        raw_headers = msg.headers() or []
        pairs = raw_headers.items() if isinstance(raw_headers, dict) else raw_headers
        original = [(str(k), v if isinstance(v, bytes) else str(v or "").encode()) for k, v in pairs]
        total = sum(len(k.encode()) + len(v) for k, v in original)
        if total > DLQ_HEADERS_LIMIT or any(len(k) > _HEADER_NAME_LIMIT for k, _ in original):
            extra += [("kiln-dlq-original-headers-bytes", str(total).encode()),
                      ("kiln-dlq-original-headers-count", str(len(original)).encode())]
            everything = json.dumps([[k, base64.b64encode(v).decode()] for k, v in original]).encode()
            await self._claim_check(extra, "kiln-dlq-headers-claim-check", everything)
            kept: list[tuple[str, bytes]] = []
            room = DLQ_HEADERS_LIMIT
            for name, data in original:
                name = name[:_HEADER_NAME_LIMIT]
                if room <= len(name.encode()):
                    break
                room -= len(name.encode())
                kept.append((name, data[:room]))
                room -= len(kept[-1][1])
            original = kept
        value = msg.value() or b""
        if len(value) > DLQ_VALUE_LIMIT:
            extra.append(("kiln-dlq-original-bytes", str(len(value)).encode()))
            if await self._claim_check(extra, "kiln-dlq-claim-check", value):
                value = b""
            else:
                extra.append(("kiln-dlq-truncated", b"true"))
                value = value[:DLQ_VALUE_LIMIT]
        return key, value, extra, original

    async def _claim_check(self, extra: list[tuple[str, bytes]], header: str, data: bytes) -> bool:
        """Store ``data`` in the blob store and name its digest in ``header``; False without a store or when the
        store fails (recorded in ``kiln-dlq-claim-check-error``): the caller keeps a cut copy."""
        if self.blob_store is None:
            return False
        store = self.blob_store
        try:
            digest = (await asyncio.to_thread(store.put, data)).digest
        except BlobError as e:
            extra.append(("kiln-dlq-claim-check-error", str(e).encode()[:1000]))
            return False
        extra.append((header, digest.encode()))
        return True
