"""Runs one job end to end, whatever delivered it: decode, the middleware chain, the handler, the result to the
request's ``reply_to``, and the dead-letter record on terminal failure.

Both consumption modes use it: consumer groups (``streams.runtime``) and share groups (``streams.share``), so a
stage's handler and the client are the same in either.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kiln.schemas.envelope import ErrorInfo, RequestEnvelope, ResultEnvelope
from kiln.streams import codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import BlobError, BlobUnavailable, KilnError, MalformedRequest
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.middleware import Job, Middleware, Outcome, default_middleware, error_info, stage_chain
from kiln.streams.offsets import coordinates
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import JobContext, Stage

REPLY_ATTEMPTS = 4
DLQ_VALUE_LIMIT = 900_000
"""Largest request value copied into a dead letter as is (the producer refuses ~1 MB; headers need room): above
it the dead letter carries a claim check (or, without a blob store, a truncated copy) and the source coordinates."""


def new_worker_id() -> str:
    """Unique per process and start: host, pid and a random suffix (a restarted pid is another worker)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def producer_config(settings: KilnSettings, **extra: Any) -> dict[str, Any]:
    """Idempotent producer: retries never duplicate or reorder a partition's records."""
    return settings.kafka(**{"enable.idempotence": True, "acks": "all", "linger.ms": 2, "compression.type": "zstd",
                             "message.timeout.ms": 120000, **extra})


def _settle(batch: list[tuple[asyncio.Future[None], str | None]]) -> None:
    for done, error in batch:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(KilnError(error))


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
        self._chain = stage_chain(stage, middleware or default_middleware(metrics, settings.job_timeout_s),
                                  blob_store)
        self._producer: Producer | None = None
        self._topic_partitions: dict[str, int] = {}  # reply topics seen to exist, with their partition counts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = threading.Event()
        self._delivery_thread: threading.Thread | None = None
        # Delivery reports, filled by librdkafka callbacks in whichever thread polls, handed to the loop in batches:
        # one wake-up of the loop per poll, not one per record.
        self._settled: collections.deque[tuple[asyncio.Future[None], str | None]] = collections.deque()

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

        ``release_slot`` is called once the handler is done, before its result is published. Raises only when not
        even a dead-letter record could be delivered.
        """
        started = datetime.now(UTC)
        try:
            envelope = codec.decode_request(msg.value())
            if envelope.kind != self.stage.name:
                raise MalformedRequest(f"kind {envelope.kind!r} sent to stage {self.stage.name!r}")
        except MalformedRequest as e:
            release_slot()
            await self.dead_letter(msg, error_info(e, False), attempts=0)
            await self.reply_error(msg, error_info(e, False))
            return None
        topic, partition, offset = coordinates(msg)
        raw_key = msg.key()
        ctx = JobContext(envelope=envelope, attempt=0, worker_id=self.worker_id, topic=topic,
                         partition=partition, offset=offset,
                         key=raw_key.decode(errors="replace") if raw_key is not None else None)
        outcome = await self._chain(Job(self.stage, ctx))
        release_slot()
        if outcome.dead_letter and outcome.error is not None:
            await self.dead_letter(msg, outcome.error, outcome.attempts)
        try:
            await self._reply_retrying(envelope, outcome, started)
            await self._publish_event(msg, outcome)
        except KilnError as e:
            # An unreachable reply_to (a topic that does not exist) or a blob store that stayed down: record it,
            # and tell the client (a small error result needs no claim check) rather than let it wait.
            error = ErrorInfo(type=type(e).__name__ if isinstance(e, BlobError) else "ReplyDeliveryFailed",
                              message=str(e))
            await self.dead_letter(msg, error, outcome.attempts)
            await self.reply_error(msg, error)
        return outcome

    async def _reply_retrying(self, envelope: RequestEnvelope, outcome: Outcome, started: datetime) -> None:
        """The reply, retried with backoff while the blob store (a large result's claim check) is unavailable."""
        for attempt in range(REPLY_ATTEMPTS):
            try:
                await self._reply(envelope, outcome, started)
                return
            except BlobUnavailable:
                if attempt == REPLY_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.5 * 2**attempt)

    async def produce(self, topic: str, value: bytes | None, key: bytes | str | None = None,
                      partition: int | None = None, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Produce one record and wait until the broker has it (acks=all)."""
        assert self._producer is not None and self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        settled = self._settled

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            settled.append((done, None if err is None else f"delivery to {topic} failed: {err}"))

        kwargs: dict[str, Any] = {"key": key, "headers": headers, "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, value, **kwargs)
                break
            except BufferError:  # local queue full: let the delivery thread drain it
                await asyncio.sleep(0.01)
            except KafkaException as e:  # refused locally: too large, unknown partition, ...
                raise KilnError(f"producing to {topic} failed: {e.args[0] if e.args else e}") from None
        await done

    async def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (0: it does not exist), asked once per topic."""
        assert self._producer is not None
        if topic not in self._topic_partitions:
            producer = self._producer
            md = await asyncio.to_thread(lambda: producer.list_topics(topic, timeout=10).topics.get(topic))
            if md is None or md.error is not None or not md.partitions:
                return 0
            self._topic_partitions[topic] = len(md.partitions)
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
            raise KilnError(f"reply topic {topic!r} does not exist")
        if partition is not None and partition >= count:
            raise KilnError(f"reply topic {topic!r} has no partition {partition}")

    async def _reply(self, envelope: RequestEnvelope, outcome: Outcome, started: datetime) -> None:
        if envelope.reply_to is None:
            return
        result = ResultEnvelope(
            request_id=envelope.request_id, kind=envelope.kind, client_id=envelope.client_id,
            status=outcome.status, result=outcome.result.model_dump(mode="json") if outcome.result else None,
            error=outcome.error, attempts=outcome.attempts, worker=self.worker_id, started_at=started,
            redriven_from=envelope.redriven_from,
        )
        value = result.model_dump_json().encode()
        if len(value) > self.settings.claim_check_bytes and self.blob_store is not None:
            # A claim check is blob-store I/O: off the event loop (a small result skips the thread hop).
            value = await asyncio.to_thread(codec.encode, result, self.blob_store, self.settings.claim_check_bytes)
        if not self._destination_known(envelope.reply_to.topic, envelope.reply_to.partition):
            await self._check_destination(envelope.reply_to.topic, envelope.reply_to.partition)
        await self.produce(envelope.reply_to.topic, value, key=envelope.reply_to.key,
                           partition=envelope.reply_to.partition, headers=codec.result_headers(result.request_id))

    async def _publish_event(self, msg: Message, outcome: Outcome) -> None:
        topic = self.stage.spec.events_topic
        if topic is None or outcome.status != "ok" or outcome.result is None:
            return
        await self.produce(self.settings.topic(topic), outcome.result.model_dump_json().encode(), key=msg.key())

    async def reply_error(self, msg: Message, error: ErrorInfo) -> None:
        """Best effort: if the raw request names its id and reply_to, tell the client rather than let it wait
        (also for malformed requests)."""
        try:
            raw = json.loads(msg.value() or b"")
            reply_to, request_id = raw["reply_to"], str(raw["request_id"])
            topic, key, partition = str(reply_to["topic"]), str(reply_to["key"]), reply_to.get("partition")
        except Exception:
            return
        result = ResultEnvelope(request_id=request_id, kind=str(raw.get("kind", self.stage.name)),
                                client_id=str(raw.get("client_id", "anonymous")), status="error", error=error,
                                attempts=0, worker=self.worker_id)
        where = partition if isinstance(partition, int) and not isinstance(partition, bool) else None
        with contextlib.suppress(KilnError):
            await self._check_destination(topic, where)
            await self.produce(topic, result.model_dump_json().encode(), key=key, partition=where,
                               headers=codec.result_headers(request_id))

    async def dead_letter(self, msg: Message, error: ErrorInfo, attempts: int) -> None:
        headers = [
            ("kiln-error-type", error.type.encode()),
            ("kiln-error-message", error.message.encode()[:4000]),
            ("kiln-stage", self.stage.name.encode()),
            ("kiln-attempts", str(attempts).encode()),
            ("kiln-source-topic", str(msg.topic()).encode()),
            ("kiln-source-partition", str(msg.partition()).encode()),
            ("kiln-source-offset", str(msg.offset()).encode()),
            ("kiln-worker", self.worker_id.encode()),
        ]
        raw_headers = msg.headers() or []
        pairs = raw_headers.items() if isinstance(raw_headers, dict) else raw_headers
        original = [(k, v if isinstance(v, bytes) else str(v or "").encode()) for k, v in pairs]
        value = msg.value() or b""
        if len(value) > DLQ_VALUE_LIMIT:
            headers.append(("kiln-dlq-original-bytes", str(len(value)).encode()))
            if self.blob_store is not None:
                headers.append(("kiln-dlq-claim-check", (await asyncio.to_thread(self.blob_store.put, value))
                                .digest.encode()))
                value = b""
            else:
                headers.append(("kiln-dlq-truncated", b"true"))
                value = value[:DLQ_VALUE_LIMIT]
        await self.produce(self.dlq_topic, value, key=msg.key(), headers=headers + original)
        self.metrics.dead_lettered(error.type)
