"""The asyncio client trainers use: submit thousands of jobs, await results out of order, resume after a crash.

- ``submit()`` produces a request and returns a future resolved by request id; ``call()`` awaits it and returns
  the typed result (raising ``RequestFailed`` / ``RequestExpired``).
- Results come back on one partition of the results topic chosen from the client id, read with the client's own
  consumer group; its committed offset advances only past results that were delivered (to a future, or out of
  ``unclaimed()``), so a restarted process with the same client id loses none.
- Each request id is delivered at most once per process: duplicates from replayed jobs are dropped.
- Nothing hangs silently: a request the producer refuses raises ``RequestRefused`` (its slot freed); a results topic
  re-created or truncated under the client (its id changes, or the position falls out of range) is reported and read
  again from its start, duplicates dropped by request id; a future with no result after ``result_timeout_s`` fails
  with ``ResultLost``.
- Deadlines are durations: a worker measures them from the broker's timestamp of the request, so the client's clock
  may be off; the client compares its clock with the broker's timestamps and warns when they disagree by more than
  ``clock_skew_warn_s`` (``clock_skew_s``, ``kiln_client_clock_skew_seconds``).
- Fork-safe: Kafka handles are created lazily per process id. A forked child gets fresh handles and, unless told
  otherwise, its own client id (``<id>.<pid>``) so it never consumes its parent's results.

The client knows envelopes, topics and futures only: a request kind's topic and result model come from the
registered stage specs (``kiln.streams.stage``). Each stage ships a typed facade over it next to its handler
(``LeanClient``, ``ExecClient``, ``SaucerClient``, ``BuilderClient``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
import zlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from prometheus_client import Counter, Gauge
from pydantic import BaseModel

from kiln.schemas.envelope import ReplyTo, RequestEnvelope, ResultEnvelope, new_request_id
from kiln.streams import codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import (
    BrokerUnavailable,
    ClientError,
    ConfigError,
    RequestExpired,
    RequestFailed,
    RequestRefused,
    ResultLost,
)
from kiln.streams.offsets import PartitionOffsets, commit_position, coordinates, decode_done, poll_batch
from kiln.streams.settings import KilnSettings, get_settings, producer_config
from kiln.streams.stage import RESULTS_TOPIC, StageSpec, stage_specs

log = logging.getLogger("kiln.client")
COMMIT_FAILURES = Counter("kiln_client_commit_failures_total", "Commits of the client's results position the broker "
                          "refused (re-sent).")
UNCLAIMED_SURFACED = Counter("kiln_client_unclaimed_surfaced_total",
                             "Results for requests this process did not submit, handed to on_unclaimed (or logged) "
                             "and committed past because unclaimed() did not take them in time.")
RESULTS_RESETS = Counter("kiln_client_results_resets_total", "Times the results topic went backwards under the client "
                         "(re-created, truncated) and was read again from its start.")
CLOCK_SKEW = Gauge("kiln_client_clock_skew_seconds", "This client's clock minus the broker's, as last measured from a "
                   "broker timestamp (positive: the client is ahead; includes the delivery's latency).")
RESULTS_CHECK_S = 2.0
"""How often the client asks whether its results topic is still the one it reads (its topic id)."""


class _ProcessState:
    """Everything bound to one process and one event loop; rebuilt in a forked child."""

    def __init__(self, client_id: str, loop: asyncio.AbstractEventLoop, max_in_flight: int) -> None:
        self.pid = os.getpid()
        self.client_id = client_id
        self.loop = loop
        self.pending: dict[str, asyncio.Future[ResultEnvelope]] = {}
        self.delivered: OrderedDict[str, None] = OrderedDict()
        # Results for requests this process did not submit: (envelope, offset, arrival), oldest first.
        self.unclaimed: deque[tuple[ResultEnvelope, int, float]] = deque()
        self.unclaimed_ready = asyncio.Event()
        # Requests under the client's own result bound, oldest first: request id -> when it is given up (monotonic).
        self.result_due: OrderedDict[str, float] = OrderedDict()
        self.unacked: dict[str, int] = {}  # ack mode: request id -> offset of a result handed over, not yet acked
        self.slots = asyncio.Semaphore(max_in_flight)
        self.producer: Producer | None = None
        self.queue_producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.partition = 0
        self.reply_to: ReplyTo | None = None  # where this process's results go (built once: every request says it)
        self.offsets: PartitionOffsets | None = None
        self.commit_to: TopicPartition | None = None  # latest wanted commit not sent yet; the I/O thread sends it
        self.wanted: TopicPartition | None = None  # latest wanted commit, sent or not: the final commit re-sends it
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.seq = 0
        self.admin: AdminClient | None = None
        self.topic_id: str | None = None  # of the results topic, as last seen (None: not yet known)
        self.next_topic_check = 0.0
        self.topic_check: concurrent.futures.Future[Any] | None = None  # a topic-id question under way
        self.clock_skew_s: float | None = None
        self.skew_warned_at = -1e9


_T = TypeVar("_T")
_OUT_OF_RANGE = {KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE}
_SETTLING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
             KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
             KafkaError._TIMED_OUT, KafkaError._UNKNOWN_PARTITION, KafkaError._TRANSPORT,
             KafkaError._ALL_BROKERS_DOWN}


def _retrying(fn: Callable[[], _T], limit_s: float = 30.0) -> _T:
    """``fn`` retried while the broker answers with a retriable error (e.g. a topic created a moment ago whose
    partition leaders are not known yet: NOT_LEADER_FOR_PARTITION) or does not answer (restarting): after
    ``limit_s`` of that, ``BrokerUnavailable``."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return fn()
        except KafkaException as e:
            err = e.args[0] if e.args else None
            transient = isinstance(err, KafkaError) and (err.retriable() or err.code() in _SETTLING)
            if not transient:
                raise
            if time.monotonic() > deadline:
                raise BrokerUnavailable(f"the broker did not answer for {limit_s:g} s: {err}") from e
            time.sleep(0.2)


def _received_before(consumer: Consumer, start: TopicPartition, done_ahead: list[int], client_id: str,
                    lookback_s: float, patience_s: float = 60.0) -> list[str]:
    """Request ids of the results ``client_id`` received (committed past, or finished ahead of ``start``) in the
    last ``lookback_s`` seconds: a previous life delivered them. Reads keys and headers, decoding only records
    without the request-id header."""
    end = max([start.offset, *(o + 1 for o in done_ahead)])
    if lookback_s <= 0 or end <= 0:
        return []
    since_ms = int((time.time() - lookback_s) * 1000)
    first = _retrying(lambda: consumer.offsets_for_times(
        [TopicPartition(start.topic, start.partition, since_ms)], timeout=15)[0])
    if first.offset < 0 or first.offset >= end:
        return []
    done = set(done_ahead)
    key = client_id.encode()
    received: list[str] = []
    consumer.assign([TopicPartition(start.topic, start.partition, first.offset)])
    deadline = time.monotonic() + patience_s
    try:
        while time.monotonic() < deadline:
            for msg in poll_batch(consumer, 0.5):
                offset = msg.offset()
                if msg.error() is not None or offset is None:
                    continue
                if offset >= end:
                    return received
                if msg.key() == key and (offset < start.offset or offset in done):
                    request_id = codec.result_request_id(msg.value() or b"", msg.headers())
                    if request_id is not None:
                        received.append(request_id)
            position = consumer.position([TopicPartition(start.topic, start.partition)])[0].offset
            if position >= end:
                return received
        log.warning("recalling the results received before %s[%d]@%d took over %.0f s; %d recalled, later "
                    "duplicates of the rest may be delivered again", start.topic, start.partition, start.offset,
                    patience_s, len(received))
        return received
    finally:
        consumer.unassign()


class KilnClient:
    def __init__(
        self,
        settings: KilnSettings | None = None,
        client_id: str | None = None,
        *,
        results_topic: str = RESULTS_TOPIC,
        max_in_flight: int = 10_000,
        key_spread: int = 4,
        blob_store: BlobStore | None = None,
        child_client_id: Callable[[str, int], str] | None = None,
        unclaimed_limit: int = 10_000,
        unclaimed_max_age_s: float = 300.0,
        on_unclaimed: Callable[[ResultEnvelope], None] | None = None,
        ack_mode: bool = False,
        dedup_lookback_s: float = 600.0,
        result_timeout_s: float | None = 3600.0,
        clock: Callable[[], float] = time.time,
        clock_skew_warn_s: float = 30.0,
        on_results_reset: Callable[[str], None] | None = None,
        start_patience_s: float = 30.0,
    ) -> None:
        """``unclaimed_limit`` / ``unclaimed_max_age_s``: results this process did not submit wait for
        ``unclaimed()`` until there are more than the limit or the oldest is older than the age; then they are
        handed to ``on_unclaimed`` (else logged), counted in ``kiln_client_unclaimed_surfaced_total``, and
        committed past, so they can never pin the client's offset. ``ack_mode``: a result counts as delivered (and
        is committed past) only when the application calls ``ack(request_id)``; a process that dies before that
        gets it again, in its next life, from ``unclaimed()``. ``dedup_lookback_s``: on start, the results this
        client id received in that many seconds before its committed position are read back (headers only), so a
        replayed job's second result arriving after a restart is dropped as a duplicate, not delivered again.
        ``result_timeout_s``: a request without its result this long after ``submit()`` fails with ``ResultLost``
        (None: wait for ever; ``submit(result_timeout_s=...)`` overrides it per request). ``clock``: this client's
        wall clock (seconds since the epoch) for ``created_at``; its disagreement with the broker's timestamps
        beyond ``clock_skew_warn_s`` is logged as a warning. ``on_results_reset``: called (with why) when the
        results topic went backwards and is read again from its start. ``start_patience_s``: how long the first use
        (``submit()``, ``unclaimed()``) waits for the broker to tell the results partition's position before
        ``submit()`` raises ``BrokerUnavailable`` (``unclaimed()`` keeps waiting: it waits for results anyway)."""
        self.settings = settings or get_settings()
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.results_topic = self.settings.topic(results_topic)
        self.max_in_flight = max_in_flight
        self.key_spread = max(1, key_spread)
        self.blob_store = blob_store
        self._child_client_id = child_client_id or (lambda cid, pid: f"{cid}.{pid}")
        self._queue_topics = {self.settings.topic(t) for t in self.settings.queue_topics}
        self._state: _ProcessState | None = None
        self._start_lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._owner_pid = os.getpid()
        self._specs: dict[str, StageSpec] | None = None
        self.unclaimed_limit = unclaimed_limit
        self.unclaimed_max_age_s = unclaimed_max_age_s
        self._on_unclaimed = on_unclaimed
        self.ack_mode = ack_mode
        self.dedup_lookback_s = dedup_lookback_s
        self.result_timeout_s = result_timeout_s
        self._clock = clock
        self.clock_skew_warn_s = clock_skew_warn_s
        self._on_results_reset = on_results_reset
        self.start_patience_s = start_patience_s

    def spec(self, kind: str) -> StageSpec | None:
        """The registered spec of stage ``kind`` (entry point group ``kiln.stages``, read once per client)."""
        if self._specs is None:
            self._specs = stage_specs()
        return self._specs.get(kind)

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def _current(self) -> _ProcessState | None:
        """The state of this process and the running loop, once started (``_ready`` starts it)."""
        state = self._state
        if state is not None and state.pid == os.getpid() and state.loop is asyncio.get_running_loop():
            return state
        return None

    async def _ready(self) -> _ProcessState:
        loop = asyncio.get_running_loop()
        state = self._current()
        if state is not None:
            return state
        state = self._state
        if os.getpid() != self._owner_pid:
            # Forked child: the parent's librdkafka threads did not survive fork(); never touch its handles.
            self.client_id = self._child_client_id(self.client_id, os.getpid())
            self._owner_pid = os.getpid()
            self._start_lock = None
        if state is not None and state.pid == os.getpid() and state.loop is not loop:
            state.stop.set()  # the loop it was bound to is gone (e.g. a second asyncio.run)
            self._state = None
        if self._start_lock is None or self._lock_loop is not loop:
            # One lock per loop: concurrent first uses (say, a task draining unclaimed() and one submitting) must
            # wait for one start, not each start a consumer of its own on the results partition.
            self._start_lock, self._lock_loop = asyncio.Lock(), loop
        async with self._start_lock:
            if self._state is None or self._state.pid != os.getpid() or self._state.loop is not loop:
                self._state = await self._start(loop)
        return self._state

    async def _start(self, loop: asyncio.AbstractEventLoop) -> _ProcessState:
        state = _ProcessState(self.client_id, loop, self.max_in_flight)
        state.producer = Producer(producer_config(self.settings, **{"client.id": self.client_id}))
        # Queue-mode topics get one record per producer batch: a share group acquires whole batches, so batched
        # requests would hand one slot many jobs while others idle. (It costs throughput, so only for them.)
        state.queue_producer = Producer(producer_config(
            self.settings, **{"client.id": f"{self.client_id}.queue", "batch.num.messages": 1}))
        consumer = Consumer(self.settings.kafka(**{
            "group.id": f"kiln-client.{self.client_id}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "fetch.wait.max.ms": 10,
            # A position past the end (the topic re-created or truncated) is an error the client handles (reads the
            # partition again from its start), never a silent jump to the end.
            "auto.offset.reset": "error",
            "on_commit": lambda err, parts: self._on_commit(state, err, parts),
        }))
        state.consumer = consumer
        state.admin = AdminClient(self.settings.kafka())

        ask_s = min(15.0, max(1.0, self.start_patience_s))  # one question's timeout, within the patience

        def position() -> TopicPartition:
            md = consumer.list_topics(self.results_topic, timeout=ask_s).topics.get(self.results_topic)
            if md is not None and md.error is not None:
                raise ConfigError(f"results topic {self.results_topic}: {md.error.str()} (does it exist, and may "
                                  f"this principal describe it?)")
            if md is None or not md.partitions:
                raise ConfigError(f"results topic {self.results_topic} does not exist (kiln topics create)")
            state.partition = zlib.crc32(self.client_id.encode()) % len(md.partitions)
            tp = TopicPartition(self.results_topic, state.partition)
            committed = consumer.committed([tp], timeout=ask_s)[0]
            if committed.offset == OFFSET_INVALID or committed.offset < 0:
                # First run of this client id: results start after what is on the partition now. Commit that
                # position at once, so a restart before any result arrives still reads from here.
                _low, high = consumer.get_watermark_offsets(tp, timeout=ask_s)
                start = TopicPartition(self.results_topic, state.partition, high)
                consumer.commit(offsets=[start], asynchronous=False)
                return start
            return committed

        try:
            start = await asyncio.to_thread(_retrying, position, self.start_patience_s)
            state.reply_to = ReplyTo(topic=self.results_topic, key=state.client_id, partition=state.partition)
            state.topic_id = await asyncio.to_thread(self._results_topic_id, state)
            state.next_topic_check = time.monotonic() + RESULTS_CHECK_S
            state.offsets = PartitionOffsets(start.offset, decode_done(start.offset, start.metadata))
            received = await asyncio.to_thread(_received_before, consumer, start, state.offsets.done_ahead(),
                                               self.client_id, self.dedup_lookback_s)
        except BaseException:
            await asyncio.to_thread(consumer.close)  # a later first use starts again with handles of its own
            raise
        for request_id in received:
            self._mark_delivered(state, request_id)
        consumer.assign([TopicPartition(self.results_topic, state.partition, start.offset)])
        state.thread = threading.Thread(target=self._io_main, args=(state,), name="kiln-client-io", daemon=True)
        state.thread.start()
        self._schedule_sweeps(state)
        return state

    async def close(self) -> None:
        """Commit delivered results and release the Kafka handles of this process."""
        state = self._state
        if state is None or state.pid != os.getpid():
            return
        self._queue_commit(state)
        state.stop.set()
        if state.thread:
            await asyncio.to_thread(state.thread.join, 15)
        for fut in state.pending.values():
            fut.cancel()  # their results stay on the topic for the next client with this id
        self._state = None

    async def __aenter__(self) -> KilnClient:
        await self._ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- submitting ---------------------------------------------------------------------------------------

    async def submit(
        self,
        kind: str,
        payload: BaseModel | dict[str, Any],
        *,
        key: str | None = None,
        deadline_s: float | None = None,
        topic: str | None = None,
        request_id: str | None = None,
        partition: int | None = None,
        lane: str | None = None,
        result_timeout_s: float | None = None,
    ) -> asyncio.Future[ResultEnvelope]:
        """Send one request; the returned future resolves with its ``ResultEnvelope``. ``partition`` pins the
        request to one partition (e.g. the one whose worker holds an exec session); ``lane`` names its job class
        for workers' slot budgets (``KILN_LANES``); ``result_timeout_s`` overrides the client's bound.

        ``deadline_s`` is the request's time budget: a worker answers 'expired' instead of starting it once that
        long has passed since the broker took the request (measured on the broker's and the worker's clocks, so
        this client's may be off). A request the producer refuses raises ``RequestRefused``; it holds no slot."""
        state = self._current() or await self._ready()
        spec = self.spec(kind)
        request_topic = topic or (spec.request_topic if spec else None)
        if request_topic is None:
            raise ConfigError(f"no stage {kind!r} is installed (entry point group kiln.stages): pass topic=")
        created_at = datetime.fromtimestamp(self._clock(), UTC)
        value = None
        if spec is not None and request_id is None and lane is None and deadline_s is None:
            # Nothing the caller chose needs checking (a registered kind; id, clock and address are the client's
            # own): the envelope's JSON directly, without building (validating) it.
            rid = new_request_id()
            value = codec.request_json(rid, kind, state.client_id, created_at, state.reply_to, payload)
            if len(value) > self.settings.claim_check_bytes and self.blob_store is not None:
                value = None  # its payload goes to the blob store: codec.encode below
        if value is None:
            body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload)
            envelope = RequestEnvelope(
                kind=kind, client_id=state.client_id, payload=body, created_at=created_at, reply_to=state.reply_to,
                lane=lane, **({"request_id": request_id} if request_id else {}),
            )
            if deadline_s is not None:
                envelope = envelope.model_copy(update={"deadline": created_at + timedelta(seconds=deadline_s)})
            rid = envelope.request_id
            if rid in state.pending or rid in state.delivered:
                raise ClientError(f"request id {rid} already used")
            value = codec.encode(envelope, self.blob_store, self.settings.claim_check_bytes)
        state.seq += 1
        msg_key = key if key is not None else f"{state.client_id}/{state.seq % self.key_spread}"
        await state.slots.acquire()
        fut: asyncio.Future[ResultEnvelope] = state.loop.create_future()
        state.pending[rid] = fut
        fut.add_done_callback(lambda _f: state.slots.release())
        try:
            while True:
                if self._produce(state, self.settings.topic(request_topic), value, msg_key, rid, partition,
                                 codec.request_headers(state.client_id, lane)):
                    break
                await asyncio.sleep(0.005)  # the local queue is full: the I/O thread drains it
        except BaseException:
            # Not sent: nothing will resolve the future, so it must not keep its slot or count as pending.
            state.pending.pop(rid, None)
            fut.cancel()
            raise
        if deadline_s is not None:
            state.loop.call_later(deadline_s + 1.0, self._expire, state, rid)
        if result_timeout_s is not None:
            state.loop.call_later(result_timeout_s, self._give_up, state, rid, result_timeout_s)
        elif self.result_timeout_s is not None:
            state.result_due[rid] = time.monotonic() + self.result_timeout_s  # (_give_up_overdue)
        return fut

    async def call(self, kind: str, payload: BaseModel | dict[str, Any], **kwargs: Any) -> Any:
        """Submit and await: the stage's typed result, or ``RequestFailed`` / ``RequestExpired``."""
        envelope = await (await self.submit(kind, payload, **kwargs))
        return self.result_of(envelope)

    def result_of(self, envelope: ResultEnvelope) -> Any:
        if envelope.status == "expired":
            raise RequestExpired(f"request {envelope.request_id} expired before it started")
        if envelope.status == "error":
            err = envelope.error
            raise RequestFailed(envelope.request_id, f"{err.type}: {err.message}" if err else "unknown error",
                                err.type if err else "")
        body = codec.result_body(envelope, self.blob_store) or {}
        spec = self.spec(envelope.kind)
        return spec.result_model.model_validate(body) if spec else body

    async def unclaimed(self) -> AsyncIterator[ResultEnvelope]:
        """Results for requests this process did not submit (e.g. before a restart with the same client id). A broker
        away when it starts is waited for (a task draining it must not die of a restart)."""
        while True:
            try:
                state = await self._ready()
                break
            except BrokerUnavailable as e:
                log.warning("client %s: waiting for the broker to read its results: %s", self.client_id, e)
        while True:
            while not state.unclaimed:
                state.unclaimed_ready.clear()
                await state.unclaimed_ready.wait()
            envelope, offset, _arrived = state.unclaimed.popleft()
            if envelope.request_id in state.delivered:
                self._finish(state, offset)
                continue
            # Handing it over is delivery (as resolving a future is): never yielded twice; committed past now, or
            # in ack mode once acknowledged.
            self._deliver(state, envelope.request_id, offset)
            yield envelope

    def ack(self, request_id: str) -> None:
        """Ack mode: the application is done with this result (e.g. stored it durably); commit past it."""
        state = self._state
        if state is None or state.pid != os.getpid():
            raise ClientError("ack() from a process that did not receive the result")
        offset = state.unacked.pop(request_id, None)
        if offset is None:
            raise ClientError(f"no unacknowledged result for request {request_id}")
        self._finish(state, offset)

    def _deliver(self, state: _ProcessState, request_id: str, offset: int, commit: bool = True) -> None:
        self._mark_delivered(state, request_id)
        if self.ack_mode:
            state.unacked[request_id] = offset
        else:
            self._finish(state, offset, commit)

    def _sweep_unclaimed(self, state: _ProcessState) -> None:
        """Surface (and commit past) unclaimed results over the limit or past the age: they must not pin the
        client's offset when the application never drains ``unclaimed()``."""
        oldest_allowed = time.monotonic() - self.unclaimed_max_age_s
        while state.unclaimed and (len(state.unclaimed) > self.unclaimed_limit
                                   or state.unclaimed[0][2] < oldest_allowed):
            envelope, offset, _arrived = state.unclaimed.popleft()
            if envelope.request_id not in state.delivered:
                UNCLAIMED_SURFACED.inc()
                if self._on_unclaimed is not None:
                    self._on_unclaimed(envelope)
                else:
                    log.warning("result of request %s (%s, %s) was never claimed; committed past it",
                                envelope.request_id, envelope.kind, envelope.status)
                self._mark_delivered(state, envelope.request_id)
            self._finish(state, offset)

    def _give_up_overdue(self, state: _ProcessState) -> None:
        """Fail the futures still without a result ``result_timeout_s`` after their submit (the client's bound; a
        request's own bound has a timer of its own). One sweep for all, not a timer per request: a timer per
        request cost the client a tenth of its time."""
        bound, now = self.result_timeout_s, time.monotonic()
        while bound is not None and state.result_due:
            request_id, due = next(iter(state.result_due.items()))
            if due > now:
                return
            del state.result_due[request_id]
            self._give_up(state, request_id, bound)

    def _schedule_sweeps(self, state: _ProcessState) -> None:
        if state.stop.is_set():
            return
        self._sweep_unclaimed(state)
        self._give_up_overdue(state)
        every = min(1.0, self.unclaimed_max_age_s / 2, (self.result_timeout_s or 1.0) / 2)
        state.loop.call_later(every, self._schedule_sweeps, state)

    def _produce(self, state: _ProcessState, topic: str, value: bytes, key: str, request_id: str,
                 partition: int | None = None, headers: list[tuple[str, bytes]] | None = None) -> bool:
        """Queue the request without waiting for the broker (a failed delivery fails the request's future); False
        while the local queue is full."""
        assert state.producer is not None and state.queue_producer is not None
        producer = state.queue_producer if topic in self._queue_topics else state.producer

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                error = (RequestRefused(f"request {request_id} to {topic[:100]!r} was not sent: the client closed "
                                        "before the broker took it") if err.code() == KafkaError._PURGE_QUEUE
                         else ClientError(f"request delivery to {topic} failed: {err}"))
                state.loop.call_soon_threadsafe(self._fail, state, request_id, error)
                return
            kind, broker_ms = msg.timestamp()
            if kind == TIMESTAMP_LOG_APPEND_TIME and broker_ms > 0:
                self._note_clock(state, broker_ms, either_way=True)

        try:
            extra: dict[str, Any] = {"headers": headers} if headers else {}
            if partition is not None:
                extra["partition"] = partition
            producer.produce(topic, value, key=key, on_delivery=on_delivery, **extra)
            return True
        except BufferError:
            return False
        except (KafkaException, ValueError, RuntimeError, TypeError) as e:
            # Refused locally (too large, an invalid topic or partition): this record can never be sent.
            reason = e.args[0].str() if isinstance(e, KafkaException) and e.args and isinstance(
                e.args[0], KafkaError) else f"{type(e).__name__}: {e}"
            raise RequestRefused(f"request {request_id} to {topic[:100]!r} refused: {reason}") from None

    def _note_clock(self, state: _ProcessState, broker_ms: int, either_way: bool) -> None:
        """Compare this client's clock with a broker timestamp just seen: a delivery report's (the broker stamped
        it a moment ago: ``either_way``) or a result's (stamped some time before it is read: only a broker ahead of
        this client tells anything). Beyond ``clock_skew_warn_s``: a warning, at most once a minute."""
        skew = self._clock() - broker_ms / 1000
        if not either_way and skew > -self.clock_skew_warn_s:
            return
        state.clock_skew_s = skew
        CLOCK_SKEW.set(skew)
        now = time.monotonic()
        if abs(skew) > self.clock_skew_warn_s and now - state.skew_warned_at > 60:
            state.skew_warned_at = now
            log.warning("client %s: its clock is %+.1f s off the broker's (deadlines are measured by the broker and "
                        "the workers, so they still hold; timestamps this client writes are off by as much)",
                        state.client_id, skew)

    @property
    def clock_skew_s(self) -> float | None:
        """This client's clock minus the broker's, as last measured (None: not measured yet: the broker stamps
        records with its own time only on topics with ``message.timestamp.type=LogAppendTime``)."""
        return self._state.clock_skew_s if self._state is not None else None

    @staticmethod
    def _fail(state: _ProcessState, request_id: str, error: Exception) -> None:
        fut = state.pending.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    # ---- results ------------------------------------------------------------------------------------------

    def _io_main(self, state: _ProcessState) -> None:
        assert state.consumer is not None and state.producer is not None and state.queue_producer is not None
        try:
            while not state.stop.is_set():
                state.producer.poll(0)
                if len(state.queue_producer):  # idle most of the time; polling it anyway costs dispatch rate
                    state.queue_producer.poll(0)
                self._send_commit(state, asynchronous=True)
                msgs = poll_batch(state.consumer, 0.02)
                out_of_range = [m for m in msgs if (err := m.error()) is not None and err.code() in _OUT_OF_RANGE]
                if msgs:
                    try:
                        state.loop.call_soon_threadsafe(self._on_results, state, msgs)
                    except RuntimeError:  # the owning loop closed without closing the client (e.g. a forked test)
                        break
                if out_of_range:
                    self._reread_results(state, f"position out of range ({out_of_range[0].error()})")
                else:
                    self._check_topic_id(state)
            flushed_by = time.monotonic() + 10  # within close()'s wait for this thread
            for producer in (state.producer, state.queue_producer):
                producer.flush(max(0.0, flushed_by - time.monotonic()))
                if len(producer):
                    # Requests the broker never took (it is away): their futures fail now (RequestRefused), rather
                    # than being left to a next life that can never receive their results. Ones in flight stay:
                    # the broker may have them.
                    producer.purge(in_queue=True, in_flight=False, blocking=False)
                    producer.flush(0)  # their delivery reports
            self._send_commit(state, asynchronous=False)
        finally:
            with contextlib.suppress(Exception):
                state.consumer.close()

    def _results_topic_id(self, state: _ProcessState) -> str | None:
        """The results topic's id (it changes when the topic is re-created); None while it cannot be told (the
        topic is deleted, the broker away)."""
        if state.admin is None:
            return None
        try:
            future = state.admin.describe_topics(TopicCollection([self.results_topic]), request_timeout=5)
            return str(future[self.results_topic].result(10).topic_id)
        except Exception:
            return None

    def _check_topic_id(self, state: _ProcessState) -> None:
        """(I/O thread, every ``RESULTS_CHECK_S``, never waiting.) Ask for the results topic's id; when a new id
        answers, the topic was re-created under this client: its partition is read again from the start."""
        if state.topic_check is None:
            if state.admin is None or time.monotonic() < state.next_topic_check:
                return
            state.next_topic_check = time.monotonic() + RESULTS_CHECK_S
            state.topic_check = state.admin.describe_topics(TopicCollection([self.results_topic]),
                                                            request_timeout=5)[self.results_topic]
            return
        if not state.topic_check.done():
            return
        check, state.topic_check = state.topic_check, None
        try:
            topic_id = str(check.result().topic_id)
        except Exception:
            return  # deleted right now, or the broker away: asked again later
        if state.topic_id is not None and topic_id != state.topic_id:
            self._reread_results(state, f"was re-created (topic id {state.topic_id} -> {topic_id})")
        state.topic_id = topic_id

    def _reread_results(self, state: _ProcessState, why: str) -> None:
        """(I/O thread.) The results topic went backwards under this client: read its partition again from the start
        (what was delivered already is dropped by request id) and tell the loop to start a fresh offset map."""
        assert state.consumer is not None
        state.consumer.assign([TopicPartition(self.results_topic, state.partition, OFFSET_BEGINNING)])
        with contextlib.suppress(RuntimeError):
            state.loop.call_soon_threadsafe(self._on_reread, state, why)

    def _on_reread(self, state: _ProcessState, why: str) -> None:
        RESULTS_RESETS.inc()
        log.error("results topic %s %s: results sent to the old one and not received are lost (their futures fail "
                  "with ResultLost after result_timeout_s); reading partition %d again from its start",
                  self.results_topic, why, state.partition)
        state.offsets = PartitionOffsets(0)  # offsets below the log's start are gaps it skips
        state.commit_to = state.wanted = TopicPartition(self.results_topic, state.partition, 0)
        # Offsets held for later commits point into the old topic: nothing to commit past any more.
        state.unacked = dict.fromkeys(state.unacked, -1)
        state.unclaimed = deque((envelope, -1, arrived) for envelope, _offset, arrived in state.unclaimed)
        if self._on_results_reset is not None:
            self._on_results_reset(why)

    @staticmethod
    def _send_commit(state: _ProcessState, asynchronous: bool) -> None:
        """Send the latest wanted commit. Asynchronous ones are checked in ``_on_commit``; the final synchronous
        one is checked and retried (a lost final commit makes the next life re-read results); it re-sends the
        latest position even if an asynchronous commit carried it, since that one may not have landed yet."""
        tp, state.commit_to = state.commit_to, None
        if not asynchronous:
            tp = state.wanted
        if tp is None or state.consumer is None:
            return
        if asynchronous:
            with contextlib.suppress(KafkaException):  # a local refusal: the next wanted commit supersedes it
                state.consumer.commit(offsets=[tp], asynchronous=True)
            return
        for attempt in range(5):
            try:
                if not any(p.error for p in state.consumer.commit(offsets=[tp], asynchronous=False) or []):
                    return
            except KafkaException as e:
                log.warning("final commit of results failed (attempt %d): %s", attempt + 1, e)
            COMMIT_FAILURES.inc()
            time.sleep(0.5 * (attempt + 1))

    def _on_commit(self, state: _ProcessState, err: KafkaError | None, parts: list[TopicPartition]) -> None:
        """A refused asynchronous commit (e.g. while the coordinator moves after a broker restart) is counted and
        sent again with the latest position, even if no further result arrives to trigger one."""
        if err is None and not any(p.error for p in parts):
            return
        COMMIT_FAILURES.inc()
        with contextlib.suppress(RuntimeError):  # the loop is gone: close() sends the final commit
            state.loop.call_soon_threadsafe(state.loop.call_later, 0.5, self._queue_commit, state)

    def _on_results(self, state: _ProcessState, msgs: list[Message]) -> None:
        assert state.offsets is not None
        if state.stop.is_set():
            return  # closing: the final commit may be sent already, so these stay for the next life
        for msg in msgs:
            if msg.error() is not None:
                continue
            kind, broker_ms = msg.timestamp()
            if kind == TIMESTAMP_LOG_APPEND_TIME and broker_ms > 0:
                self._note_clock(state, broker_ms, either_way=False)
            offset = coordinates(msg)[2]
            if not state.offsets.receive(offset):
                continue
            try:
                envelope = codec.decode_result(msg.value() or b"")
            except Exception:
                self._finish(state, offset, commit=False)
                continue
            if envelope.client_id != state.client_id or envelope.request_id in state.delivered:
                self._finish(state, offset, commit=False)
                continue
            fut = state.pending.pop(envelope.request_id, None)
            if fut is None:
                state.unclaimed.append((envelope, offset, time.monotonic()))
                state.unclaimed_ready.set()
                continue
            self._deliver(state, envelope.request_id, offset, commit=False)
            if not fut.done():
                fut.set_result(envelope)
        self._queue_commit(state)  # once per batch: the commit position encodes the whole offset map
        self._sweep_unclaimed(state)

    def _give_up(self, state: _ProcessState, request_id: str, after_s: float) -> None:
        if request_id in state.pending:
            self._mark_delivered(state, request_id)
            self._fail(state, request_id, ResultLost(request_id, after_s))

    def _expire(self, state: _ProcessState, request_id: str) -> None:
        if request_id in state.pending:
            self._mark_delivered(state, request_id)
            self._fail(state, request_id, RequestExpired(f"no result for {request_id} before its deadline"))

    @staticmethod
    def _mark_delivered(state: _ProcessState, request_id: str) -> None:
        state.result_due.pop(request_id, None)
        state.delivered[request_id] = None
        if len(state.delivered) > 1_000_000:
            state.delivered.popitem(last=False)

    def _finish(self, state: _ProcessState, offset: int, commit: bool = True) -> None:
        assert state.offsets is not None
        if offset < 0:
            return  # a result read from a results topic since re-created: nothing to commit past
        state.offsets.finish(offset)
        if commit:
            self._queue_commit(state)

    def _queue_commit(self, state: _ProcessState) -> None:
        if state.offsets is None:
            return
        state.commit_to = state.wanted = commit_position(self.results_topic, state.partition, state.offsets)

    @property
    def in_flight(self) -> int:
        return len(self._state.pending) if self._state else 0

    async def settled(self) -> None:
        """Until every request this process has submitted so far has its result (or was given up)."""
        state = self._state
        if state is not None and state.pending:
            await asyncio.wait(list(state.pending.values()))
