"""The job runtime: runs one stage's handler over its request topic with commit-after-finish semantics.

Threads: one thread owns the Kafka consumer (poll, commit, pause/resume, rebalance callbacks); one serves the
producer's delivery reports; jobs run as asyncio tasks on the event loop. The loop talks to the consumer thread
through a command queue, the consumer thread to the loop through ``call_soon_threadsafe``.

Semantics (docs/architecture.md, "The runtime's guarantees"):
- an offset is committed only when every job at or below it has finished; jobs finished beyond it travel in
  the commit metadata (``streams.offsets``) and are skipped by the next owner;
- at most ``slots`` jobs run; each partition at most ``max_in_flight_per_partition``; a free slot goes to the
  client with the least slot time among those with a job that may start (``streams.fairqueue``), whichever
  partitions they share; once the read-ahead (``KILN_READAHEAD_BYTES``) is full, partitions holding more than their
  share of it are paused, while polling continues (one flooded partition may fill it alone: a light client's job
  deep behind the flood is still seen);
- keyed mode runs jobs with the same key one at a time, in offset order;
- lanes (``KILN_LANES``): a lane's jobs hold at most its slot budget; others in the backlog start past them;
- revoke or SIGTERM: stop intake, let running jobs finish within the grace period, commit, abandon the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kiln.streams import admin, codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import OffsetMapError
from kiln.streams.fairqueue import FairQueue, Queued
from kiln.streams.lifecycle import WorkerLifecycle
from kiln.streams.middleware import Middleware
from kiln.streams.offsets import SPILL_PREFIX, PartitionOffsets, commit_position, coordinates, decode_done, poll_batch
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import Stage

HANDOVER_S = 25.0  # what a stage's revoke hook may take, inside the revoke's margin beyond the grace period
log = logging.getLogger("kiln.runtime")

TP = tuple[str, int]
RECORD_OVERHEAD = 512
"""Bytes a buffered record is counted for beyond its key and value (the message and queue objects)."""
MIN_PARTITION_READAHEAD = 1 << 20
SPILL_INTERVAL_S = 0.25
"""At most this often a partition's spilled finished-ahead map is stored again (a blob per commit)."""
FREEZE_S = 2.0
"""A consumer thread silent this long was frozen (SIGSTOP, a stalled VM) or starved: no job starts until a
commit proves this worker still owns its partitions (a zombie's group may have moved on)."""


def _commit_now(consumer: Consumer, offsets: list[TopicPartition]) -> tuple[list[TopicPartition], object]:
    """A synchronous commit: the partitions the broker refused (all, if the request failed) and why."""
    try:
        refused = [tp for tp in consumer.commit(offsets=offsets, asynchronous=False) or [] if tp.error]
    except KafkaException as e:
        return offsets, e.args[0] if e.args else e
    return refused, refused[0].error if refused else None


@dataclass
class _Partition:
    offsets: PartitionOffsets
    buffered_bytes: int = 0  # of its records in the fair queue
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    running: int = 0  # jobs of this partition holding a slot (tasks also counts ones publishing results)
    paused: bool = False
    revoking: bool = False


@dataclass
class _Slot:
    """A started job: where it came from and whose slot time it is."""

    tp: TP
    part: _Partition
    msg: Message
    lane: str | None
    client: str
    started: float


class Worker(WorkerLifecycle):
    """Runs ``stage`` from a consumer group until ``stop()`` (or SIGTERM when ``install_signal_handlers``)."""

    mode = "group"
    log = log

    def __init__(
        self,
        stage: Stage,
        settings: KilnSettings,
        *,
        slots: int | None = None,
        group_id: str | None = None,
        topic: str | None = None,
        max_in_flight_per_partition: int | None = None,
        grace_s: float | None = None,
        middleware: Sequence[Middleware] | None = None,
        blob_store: BlobStore | None = None,
        worker_id: str | None = None,
        lanes: dict[str, int] | None = None,
    ) -> None:
        super().__init__(stage, settings, slots=slots, topic=topic, group_id=group_id or f"kiln.{stage.name}",
                         grace_s=grace_s, middleware=middleware, blob_store=blob_store, worker_id=worker_id)
        self.per_partition_cap = max_in_flight_per_partition or self.slots
        self.lanes = dict(settings.lanes if lanes is None else lanes)
        self._lane_running: dict[str, int] = dict.fromkeys(self.lanes, 0)
        self.readahead_bytes = settings.readahead_bytes
        self._buffered_bytes = 0  # in the fair queue, all partitions
        self._dispatching = False
        self._queue: FairQueue[Message] = FairQueue(settings.client_weights, keyed=stage.spec.ordering == "keyed")
        self._parts: dict[TP, _Partition] = {}
        self._spilled: dict[TP, tuple[str, str, float]] = {}  # last spilled map: its text, metadata, when
        self._running = 0
        self._busy_keys: set[bytes | None] = set()
        self._dirty: set[TP] = set()
        self._last_commit: dict[TP, tuple[int, str]] = {}
        self._commands: queue.SimpleQueue[Callable[[Consumer], object]] = queue.SimpleQueue()
        # Partitions this worker owns, as the consumer thread sees them (only that thread reads or writes it): a
        # commit for anything else is dropped, so a commit queued before a revoke can never land after it.
        self._owned: set[TP] = set()
        # At most one asynchronous commit in flight (consumer thread only): the coordinator answers a connection's
        # requests one at a time, each once the offsets log has it in sync, so commits sent every few ms while that
        # write waits (a broker restarting, a slow follower) queue up, and the group heartbeat behind them times out
        # (librdkafka's timeout for it is the heartbeat interval): measured on a three-broker cluster, 690 commits
        # queued in a 4 s follower pause, 451 failed, heartbeats timing out 20 s after it. Positions produced
        # meanwhile wait here, the latest of each partition, and go when its report arrives.
        self._commit_in_flight = False
        self._commit_next: dict[TP, TopicPartition] = {}
        self._partition_ids: tuple[int, ...] = ()  # for /healthz (another thread): replaced, never mutated
        self._polled_at = time.monotonic()  # written by the consumer thread on every iteration
        self._unconfirmed = threading.Event()  # set: ownership must be proven before another job starts
        self._next_confirm = 0.0
        self._consumer_done = threading.Event()
        self._final_committed = threading.Event()
        self._commit_wake = asyncio.Event()

    # ---- the lifecycle's parts (streams.lifecycle) -------------------------------------------------------

    def _wake(self) -> None:
        self._commit_wake.set()

    def _health_details(self) -> dict[str, Any]:
        return {"busy_slots": self._running, "slots": self.slots, "partitions": list(self._partition_ids)}

    async def _prepare(self) -> None:
        self._commit_wake = asyncio.Event()

    def _start_consuming(self) -> None:
        threading.Thread(target=self._consumer_main, name="kiln-consumer", daemon=True).start()
        log.info("worker %s: stage %s on %s (%d slots, group %s)", self.worker_id, self.stage.name, self.topic,
                 self.slots, self.group_id)

    async def _serve(self) -> None:
        await self._commit_loop()
        await self._drain_all()

    async def _stop_consuming(self) -> None:
        await asyncio.to_thread(self._consumer_done.wait)

    # ---- consumer thread ----------------------------------------------------------------------------------

    def _consumer_config(self) -> dict[str, Any]:
        conf: dict[str, Any] = self.settings.kafka(**{
            "group.id": self.group_id,
            "client.id": self.worker_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            **admin.group_membership(self.settings),
            # Bounded prefetch: back-pressure is local pausing, and a revoked partition has little to drop.
            "queued.max.messages.kbytes": 4096,
            "fetch.wait.max.ms": 10,
            "on_commit": self._on_commit,
        })
        return conf

    def _consumer_main(self) -> None:
        assert self._loop is not None
        consumer = Consumer(self._consumer_config())
        consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                           on_lost=self._on_lost)
        next_lag_check = 0.0
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if now - self._polled_at > FREEZE_S:
                    self._unconfirmed.set()  # before the fresh timestamp below can let the loop dispatch
                self._polled_at = now
                if self._unconfirmed.is_set() and now >= self._next_confirm:
                    self._confirm_ownership(consumer)
                self._run_commands(consumer)
                # Short: queued commands (commits right after a finish) wait at most this long for the thread.
                msgs = poll_batch(consumer, 0.01)
                if msgs:
                    self._loop.call_soon_threadsafe(self._on_messages, msgs)
                if time.monotonic() >= next_lag_check:
                    next_lag_check = time.monotonic() + 2.0
                    self._update_queue_length(consumer)
            # Graceful stop: the loop has drained and queued the final commit.
            self._wait_final_commands(consumer)
        except Exception as e:
            log.exception("consumer thread failed")
            self._loop.call_soon_threadsafe(self.fail, f"consumer thread failed: {e!r}")
        finally:
            with contextlib.suppress(Exception):
                consumer.close()
            self._consumer_done.set()

    def _run_commands(self, consumer: Consumer) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command(consumer)
            except Exception as e:
                self.metrics.consumer_errors.inc()
                log.warning("consumer command failed: %s", e)

    def _wait_final_commands(self, consumer: Consumer) -> None:
        deadline = time.monotonic() + self.grace_s + 10
        while not self._final_committed.is_set() and time.monotonic() < deadline:
            self._run_commands(consumer)
            consumer.poll(0.05)
        self._run_commands(consumer)

    def _update_queue_length(self, consumer: Consumer) -> None:
        """High watermarks from the last fetches (cached by librdkafka: no round trip), handed to the loop, which
        owns the offsets they are compared with."""
        assert self._loop is not None
        highs: dict[TP, int] = {}
        for tp in consumer.assignment():
            _low, high = consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                highs[(tp.topic, tp.partition)] = high
        self._loop.call_soon_threadsafe(self._set_queue_length, highs)

    def _set_queue_length(self, highs: dict[TP, int]) -> None:
        total = 0
        for tp, high in highs.items():
            part = self._parts.get(tp)
            if part is not None:
                total += max(0, high - part.offsets.committable - part.offsets.finished_ahead)
        self.metrics.queue_length.set(total)
        self.metrics.assigned_partitions.set(len(self._parts))
        self.metrics.paused_partitions.set(sum(1 for p in self._parts.values() if p.paused))
        self.metrics.readahead_bytes.set(self._buffered_bytes)
        self.metrics.queued_clients.set(self._queue.clients)

    # ---- consumer thread: commits -------------------------------------------------------------------------

    def _confirm_ownership(self, consumer: Consumer) -> None:
        """After a freeze: a synchronous commit of the current positions succeeds only for a member the group still
        counts (generation / member epoch checked by the coordinator). Success lets jobs start again. On a refusal
        nothing starts: a fenced member waits for the group to take its partitions (on_lost / on_revoke drop them
        with their stale backlog) and hand out new ones (on_assign); any other refusal (a coordinator moving, a
        broker restarting) is retried every second."""
        positions: list[TopicPartition] = self._call_in_loop(lambda: self._positions(list(self._parts)), timeout=30)
        positions = [tp for tp in positions if (tp.topic, tp.partition) in self._owned]
        refused, error = _commit_now(consumer, positions) if positions else ([], None)
        if not refused:
            log.info("ownership confirmed after a freeze: %s", sorted(p for _, p in self._owned))
            self._unconfirmed.clear()
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch)
            return
        self.metrics.commit_failed(str(error))
        self._next_confirm = time.monotonic() + 1.0
        log.warning("ownership not confirmed after a freeze (%s): no job starts until it is", error)

    def _commit_owned(self, consumer: Consumer, offsets: list[TopicPartition], asynchronous: bool) -> None:
        """Commit the positions of partitions still owned; a synchronous commit is checked and retried."""
        owned = [tp for tp in offsets if (tp.topic, tp.partition) in self._owned]
        if not owned:
            return
        if asynchronous:
            if self._commit_in_flight:
                self._commit_next.update(((tp.topic, tp.partition), tp) for tp in owned)
                return
            self._commit_in_flight = True
            try:
                consumer.commit(offsets=owned, asynchronous=True)  # checked in _on_commit
            except BaseException:
                self._commit_in_flight = False
                raise
            return
        for attempt in range(3):
            failed, error = _commit_now(consumer, owned)
            if not failed:
                return
            self.metrics.commit_failed(str(error))
            log.warning("commit of %s failed (attempt %d): %s", [(t.topic, t.partition) for t in failed],
                        attempt + 1, error)
            owned = [tp for tp in owned if any(f.topic == tp.topic and f.partition == tp.partition for f in failed)]
            time.sleep(0.2 * (attempt + 1))

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """Delivery report of an asynchronous commit: failures are counted and the positions sent again; positions
        that waited for it go now."""
        self._commit_in_flight = False
        if self._commit_next:
            self._commands.put(self._commit_waiting)
        failed = [tp for tp in partitions if tp.error is not None] if err is None else partitions
        if not failed:
            return
        reason = str(err or failed[0].error)
        self.metrics.commit_failed(reason)
        log.warning("commit of %s failed: %s", [(t.topic, t.partition) for t in failed], reason)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._recommit, [(t.topic, t.partition) for t in failed])

    def _commit_waiting(self, consumer: Consumer) -> None:
        """(Consumer thread.) The positions that waited for the commit in flight, unless another went first."""
        if not self._commit_in_flight and self._commit_next:
            waiting, self._commit_next = list(self._commit_next.values()), {}
            self._commit_owned(consumer, waiting, asynchronous=True)

    def _recommit(self, tps: list[TP]) -> None:
        for tp in tps:
            if tp in self._parts:
                self._last_commit.pop(tp, None)  # identical states are otherwise never re-sent
                self._dirty.add(tp)
        self._commit_wake.set()

    def _call_in_loop(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` (sync, or returning a coroutine) on the event loop and wait for it from this thread."""
        assert self._loop is not None

        async def runner() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        future = asyncio.run_coroutine_threadsafe(runner(), self._loop)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(min(0.5, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                self._polled_at = time.monotonic()  # waiting (e.g. a revoke's grace period), not frozen

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if not partitions:
            self.ready.set()
            return
        committed = consumer.committed(partitions, timeout=30)
        states: dict[TP, PartitionOffsets] = {}
        for tp in committed:
            start = tp.offset if tp.offset >= 0 else 0
            try:
                done = decode_done(start, tp.metadata, self._fetch_spilled)
            except OffsetMapError as e:
                log.warning("ignoring offset metadata of %s[%d]: %s", tp.topic, tp.partition, e)
                done = set()
            states[(tp.topic, tp.partition)] = PartitionOffsets(start, done)
        self._call_in_loop(lambda: self._add_partitions(states), timeout=30)
        # librdkafka keeps a partition's pause across a revoke: one paused for back-pressure in an earlier
        # assignment would never be fetched again (its new state here starts unpaused). Seen when an autoscaler
        # moved partitions away from a busy worker and back.
        consumer.resume(partitions)
        self._owned.update(states)
        self._unconfirmed.clear()  # the group just handed these out: ownership is fresh
        log.info("assigned %s", sorted(p for _, p in states))
        self.ready.set()

    def _fetch_spilled(self, digest: str) -> bytes:
        if self.executor.blob_store is None:
            raise OffsetMapError("no blob store to read a spilled offset map from")
        return self.executor.blob_store.get(digest)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        final: list[TopicPartition] = self._call_in_loop(lambda: self._drain_partitions(tps),
                                                         timeout=self.grace_s + 30)
        if final:
            self._commit_owned(consumer, final, asynchronous=False)
        self._owned.difference_update(tps)  # from here on, no commit for them leaves this worker
        for tp in tps:
            self._commit_next.pop(tp, None)
        log.info("revoked %s", sorted(p for _, p in tps))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self._owned.difference_update(tps)
        for tp in tps:
            self._commit_next.pop(tp, None)
        self._call_in_loop(lambda: self._forget_partitions(tps), timeout=30)
        log.warning("lost %s", sorted(p for _, p in tps))

    # ---- event loop: partitions ---------------------------------------------------------------------------

    def _add_partitions(self, states: dict[TP, PartitionOffsets]) -> None:
        for tp, offsets in states.items():
            self._parts[tp] = _Partition(offsets)
        self._partition_ids = tuple(sorted(p for _, p in self._parts))

    async def _drain_partitions(self, tps: list[TP]) -> list[TopicPartition]:
        """Stop intake on ``tps``, give their running jobs the grace period, return their final offsets."""
        parts = {tp: self._parts[tp] for tp in tps if tp in self._parts}
        tasks: set[asyncio.Task[None]] = set()
        for tp, part in parts.items():
            part.revoking = True
            self._unbuffer(tp, part)
            tasks |= part.tasks
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        if parts and self.stage.on_revoke is not None:
            try:  # within the revoke's own margin (grace + 30 s): the partitions wait for it
                await asyncio.wait_for(self.stage.on_revoke(sorted(p for _, p in parts)), HANDOVER_S)
            except Exception:
                log.exception("the stage's revoke hook failed for %s", sorted(p for _, p in parts))
        final = await self._positions(list(parts))
        self._forget_partitions(tps)
        return final

    def _forget_partitions(self, tps: list[TP]) -> None:
        for tp in tps:
            part = self._parts.pop(tp, None)
            if part:
                self._unbuffer(tp, part)
                for task in part.tasks:
                    task.cancel()
            self._dirty.discard(tp)
            self._last_commit.pop(tp, None)
            self._spilled.pop(tp, None)
        self._partition_ids = tuple(sorted(p for _, p in self._parts))

    async def _drain_all(self) -> None:
        """Graceful stop of the whole worker: no new jobs; running ones get the grace period; final commit."""
        final = await self._drain_partitions(list(self._parts))
        if final:
            self._commands.put(lambda c: self._commit_owned(c, final, asynchronous=False))
        self._commands.put(lambda c: self._final_committed.set())

    # ---- event loop: dispatch -----------------------------------------------------------------------------

    def _readahead_share(self) -> int:
        """A partition's share of the read-ahead: past it, it is paused whenever the read-ahead is full."""
        return max(MIN_PARTITION_READAHEAD, self.readahead_bytes // max(1, len(self._parts)))

    def _on_messages(self, msgs: list[Message]) -> None:
        to_pause: list[tuple[TP, _Partition]] = []
        now = time.monotonic()
        keyed = self.stage.spec.ordering == "keyed"
        share = self._readahead_share()
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", err)
                continue
            topic, partition, offset = coordinates(msg)
            tp = (topic, partition)
            part = self._parts.get(tp)
            if part is None or part.revoking:
                continue
            if not part.offsets.receive(offset):
                self.metrics.skipped.inc()
                self._dirty.add(tp)
                continue
            key = msg.key()
            size = len(msg.value() or b"") + len(key or b"") + RECORD_OVERHEAD
            client = codec.header_value(msg.headers(), codec.CLIENT_HEADER) or "anonymous"
            # Unordered stages: a passed-over job never holds back the next one (its own offset as its key).
            self._queue.push(client, Queued(tp, key if keyed else offset, size, msg), now)
            part.buffered_bytes += size
            self._buffered_bytes += size
            if not part.paused and part.buffered_bytes >= share and self._buffered_bytes >= self.readahead_bytes:
                part.paused = True
                to_pause.append((tp, part))
        if to_pause:
            self._commands.put(lambda c: self._pause(c, to_pause))
        self._dispatch()
        if self._dirty:
            self._commit_wake.set()

    def _pause(self, consumer: Consumer, parts: list[tuple[TP, _Partition]]) -> None:
        """(Consumer thread.) Pause only what is still the same assignment of a partition: a pause queued before
        a revoke must not land on the partition's next assignment, whose state starts unpaused."""
        still = [TopicPartition(*tp) for tp, part in parts if self._parts.get(tp) is part and part.paused]
        if still:
            consumer.pause(still)

    def _unbuffer(self, tp: TP, part: _Partition) -> None:
        """Drop the partition's buffered records (revoked: the next owner reads them again)."""
        self._queue.drop(tp)
        self._buffered_bytes -= part.buffered_bytes
        part.buffered_bytes = 0

    def _dispatch(self) -> None:
        if self._stopping.is_set() or self._dispatching:
            return  # (re-entered while the loop below runs: that loop sees the freed slot)
        self._dispatching = True
        try:
            self._start_jobs()
        finally:
            self._dispatching = False

    def _start_jobs(self) -> None:
        if time.monotonic() - self._polled_at > FREEZE_S:
            self._unconfirmed.set()  # the loop resumed first: the consumer thread confirms before any start
        if self._unconfirmed.is_set():
            return
        share = self._readahead_share()
        while self._running < self.slots and self._queue.size:
            now = time.monotonic()
            picked = self._queue.pick(now, self._partition_open, self._startable)
            if picked is None:
                return
            client, queued = picked
            tp, msg = queued.tp, queued.item
            part = self._parts[tp]  # a partition's records leave the queue when it goes (_unbuffer)
            part.buffered_bytes -= queued.size
            self._buffered_bytes -= queued.size
            self._running += 1
            part.running += 1
            self.metrics.busy_slots.set(self._running)
            if self.stage.spec.ordering == "keyed":
                self._busy_keys.add(msg.key())
            lane = self._budgeted_lane(msg)
            if lane is not None:
                self._lane_running[lane] += 1
            self._queue.started(client, now)
            self._launch(_Slot(tp, part, msg, lane, client, now))
            if part.paused and (part.buffered_bytes < share // 2
                                or self._buffered_bytes < self.readahead_bytes * 3 // 4):
                part.paused = False
                resume = [TopicPartition(*tp)]
                self._commands.put(lambda c, r=resume: c.resume(r))  # type: ignore[misc]

    def _partition_open(self, tp: TP) -> bool:
        part = self._parts.get(tp)
        return part is not None and not part.revoking and part.running < self.per_partition_cap

    def _startable(self, queued: Queued[Message]) -> bool:
        """Its key is not running (keyed stages), its lane has a free slot in its budget, and, while a partition's
        finished-ahead map is full (no blob store to spill it to), it is the partition's lowest unfinished job."""
        msg = queued.item
        if msg.key() in self._busy_keys:
            return False
        lane = self._budgeted_lane(msg)
        if lane is not None and self._lane_running[lane] >= self.lanes[lane]:
            return False
        if self.executor.blob_store is None:
            offsets = self._parts[queued.tp].offsets
            return not offsets.map_full or msg.offset() == offsets.committable
        return True

    def _budgeted_lane(self, msg: Message) -> str | None:
        """The message's lane when this worker budgets it (``KILN_LANES``)."""
        if not self.lanes:
            return None
        lane = codec.lane_of(msg.headers())
        return lane if lane in self.lanes else None

    def _free_slot(self, slot: _Slot) -> None:
        """The slot frees when the handler is done; publishing its result is I/O that must not hold a slot."""
        self._running -= 1
        slot.part.running -= 1
        if slot.lane is not None:
            self._lane_running[slot.lane] -= 1
        self.metrics.busy_slots.set(self._running)
        if self.stage.spec.ordering == "keyed":
            self._busy_keys.discard(slot.msg.key())
        self._queue.finished(slot.client, slot.started, time.monotonic())
        self._dispatch()

    def _launch(self, slot: _Slot) -> None:
        """Start one job that holds a slot (counted by the caller), as a task."""
        released = False

        def release_slot() -> None:
            nonlocal released
            if not released:
                released = True
                self._free_slot(slot)

        slot.part.tasks.add(asyncio.get_running_loop().create_task(self._run_job(slot, release_slot)))

    async def _run_job(self, slot: _Slot, release_slot: Callable[[], None]) -> None:
        """Run the job and finish its offset; the slot frees once its handler is done (``JobExecutor.process``)."""
        tp, part, msg = slot.tp, slot.part, slot.msg
        try:
            await self.executor.process(msg, release_slot)
            self._job_finished(slot)
        except asyncio.CancelledError:
            pass  # abandoned on revoke/shutdown: stays uncommitted and is replayed by the next owner
        except Exception as e:
            # Even the dead-letter record could not be delivered: this worker cannot make safe progress.
            # The offset stays unfinished, so the job replays on another worker after this one stops.
            log.exception("job at %s[%d]@%s could not be completed; stopping", tp[0], tp[1], msg.offset())
            self.fail(f"job at {tp[0]}[{tp[1]}]@{msg.offset()} could not be completed: {e!r}")
        finally:
            task = asyncio.current_task()
            if task is not None:
                part.tasks.discard(task)
            release_slot()

    # ---- event loop: commits ------------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        """Commit finished offsets (with the finished-ahead map) as they change, coalesced."""
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_wake.wait(), 1.0)
            self._commit_wake.clear()
            await asyncio.sleep(self.settings.commit_interval_s)  # completions meanwhile join this commit
            await self._commit_dirty()

    async def _position(self, tp: TP, part: _Partition, now: float | None = None) -> TopicPartition | None:
        """What to commit for the partition: its committable offset and finished-ahead map, the map spilled to the
        blob store when it outgrows the metadata. With ``now`` (routine commits), a map spilled less than
        ``SPILL_INTERVAL_S`` ago is not stored again yet: None (try later)."""
        store = self.executor.blob_store
        if store is None or part.offsets.runs == 0:
            return commit_position(tp[0], tp[1], part.offsets)
        last = self._spilled.get(tp)
        if now is not None and last is not None and now - last[2] < SPILL_INTERVAL_S:
            return None  # (before encoding: a big map costs O(runs) to encode, and commits come every few ms)
        text = part.offsets.metadata(limit=None)
        if len(text) <= self.settings.offset_metadata_chars:
            return TopicPartition(tp[0], tp[1], part.offsets.committable, text)
        if last is None or last[0] != text:
            try:
                ref = await asyncio.to_thread(store.put, text.encode())
            except Exception as e:  # the store is down: the inline map (its farthest runs cut) is a re-run at worst
                log.warning("offset map of %s[%d] not spilled: %s", tp[0], tp[1], e)
                return commit_position(tp[0], tp[1], part.offsets)
            last = (text, SPILL_PREFIX + ref.digest, time.monotonic())
            self._spilled[tp] = last
            self.metrics.offset_maps_spilled.inc()
        return TopicPartition(tp[0], tp[1], part.offsets.committable, last[1])

    async def _positions(self, tps: list[TP]) -> list[TopicPartition]:
        positions = []
        for tp in tps:
            part = self._parts.get(tp)
            position = await self._position(tp, part) if part is not None else None
            if position is not None:
                positions.append(position)
        return positions

    async def _commit_dirty(self) -> None:
        offsets: list[TopicPartition] = []
        now = time.monotonic()
        for tp in list(self._dirty):
            part = self._parts.get(tp)
            if part is None or part.revoking:
                self._dirty.discard(tp)
                continue
            position = await self._position(tp, part, now)
            if position is None:  # a spilled map stored a moment ago: the next round commits it
                self._loop_later(SPILL_INTERVAL_S, self._commit_wake.set)
                continue
            self._dirty.discard(tp)
            state = (position.offset, position.metadata or "")
            if self._last_commit.get(tp) != state:
                self._last_commit[tp] = state
                offsets.append(position)
        if offsets:
            self._commands.put(lambda c: self._commit_owned(c, offsets, asynchronous=True))

    def _loop_later(self, delay: float, callback: Callable[[], object]) -> None:
        if self._loop is not None:
            self._loop.call_later(delay, callback)

    def _job_finished(self, slot: _Slot) -> None:
        slot.part.offsets.finish(coordinates(slot.msg)[2])
        self._dirty.add(slot.tp)
        self._commit_wake.set()
