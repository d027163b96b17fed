"""The job runtime: runs one stage's handler over its request topic with commit-after-finish semantics.

Threads: one thread owns the Kafka consumer (poll, commit, pause/resume, rebalance callbacks); one serves the
producer's delivery reports; jobs run as asyncio tasks on the event loop. The loop talks to the consumer thread
through a command queue, the consumer thread to the loop through ``call_soon_threadsafe``.

Semantics (docs/architecture.md, "The runtime's guarantees"):
- an offset is committed only when every job at or below it has finished; jobs finished beyond it travel in
  the commit metadata (``streams.offsets``) and are skipped by the next owner;
- at most ``slots`` jobs run; each partition at most ``max_in_flight_per_partition``; partitions are served
  round-robin and paused when their local backlog is full, while polling continues;
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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kiln.streams import admin, codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.executor import JobExecutor, new_worker_id
from kiln.streams.heartbeat import Heartbeat
from kiln.streams.metrics import WorkerMetrics, start_worker_endpoints
from kiln.streams.middleware import Middleware
from kiln.streams.offsets import (
    OffsetMapError,
    PartitionOffsets,
    commit_position,
    coordinates,
    decode_done,
    poll_batch,
)
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import Stage

HANDOVER_S = 25.0  # what a stage's revoke hook may take, inside the revoke's margin beyond the grace period
log = logging.getLogger("kiln.runtime")

TP = tuple[str, int]
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
    backlog: deque[Message] = field(default_factory=deque)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    running: int = 0  # jobs of this partition holding a slot (tasks also counts ones publishing results)
    paused: bool = False
    revoking: bool = False


class Worker:
    """Runs ``stage`` until ``stop()`` (or SIGTERM when ``install_signal_handlers``)."""

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
        self.stage = stage
        self.settings = settings
        self.slots = slots or settings.job_slots(stage.slots_per_cpu)
        self.topic = settings.topic(topic or stage.spec.request_topic)
        self.dlq_topic = f"{self.topic}.dlq"
        self.group_id = group_id or f"kiln.{stage.name}"
        self.per_partition_cap = max_in_flight_per_partition or self.slots
        self.lanes = dict(settings.lanes if lanes is None else lanes)
        self._lane_running: dict[str, int] = dict.fromkeys(self.lanes, 0)
        self.prefetch = max(2 * self.per_partition_cap, 16)
        self.grace_s = settings.grace_s if grace_s is None else grace_s
        self.worker_id = worker_id or new_worker_id()
        self.metrics = WorkerMetrics(stage.name, self.worker_id, stage.registry)
        self.metrics.slots.set(self.slots)
        self.executor = JobExecutor(stage, settings, self.metrics, self.worker_id, self.dlq_topic, blob_store,
                                    middleware)
        self._parts: dict[TP, _Partition] = {}
        self._rr: deque[TP] = deque()
        self._running = 0
        self._busy_keys: set[bytes | None] = set()
        self._dirty: set[TP] = set()
        self._last_commit: dict[TP, tuple[int, str]] = {}
        self._commands: queue.SimpleQueue[Callable[[Consumer], object]] = queue.SimpleQueue()
        # Partitions this worker owns, as the consumer thread sees them (only that thread reads or writes it): a
        # commit for anything else is dropped, so a commit queued before a revoke can never land after it.
        self._owned: set[TP] = set()
        self._partition_ids: tuple[int, ...] = ()  # for /healthz (another thread): replaced, never mutated
        self._polled_at = time.monotonic()  # written by the consumer thread on every iteration
        self._unconfirmed = threading.Event()  # set: ownership must be proven before another job starts
        self._next_confirm = 0.0
        self._stopping = threading.Event()
        self.failure: str | None = None
        self._consumer_done = threading.Event()
        self._final_committed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commit_wake = asyncio.Event()
        self.ready = threading.Event()  # set once the consumer has joined the group

    # ---- public -------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful stop: stop intake, finish running jobs within the grace period, commit, leave the group."""
        self._stopping.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._commit_wake.set)

    async def run(self, install_signal_handlers: bool = False, serve_metrics: bool = True) -> None:
        self._loop = asyncio.get_running_loop()
        self._commit_wake = asyncio.Event()
        server = start_worker_endpoints(self._loop, self.stop, self.settings.metrics_host, self.settings.metrics_port,
                                        self.metrics, self.health, install_signal_handlers=install_signal_handlers,
                                        serve_metrics=serve_metrics)
        self.metrics_port = server.server_address[1] if server else 0
        await self.executor.start(self._loop, self.slots)
        heartbeat = Heartbeat(self.settings, self.executor, self.health, topic=self.topic, group=self.group_id,
                              mode="group")
        heartbeat.start()
        consumer_thread = threading.Thread(target=self._consumer_main, name="kiln-consumer", daemon=True)
        consumer_thread.start()
        log.info("worker %s: stage %s on %s (%d slots, group %s)", self.worker_id, self.stage.name, self.topic,
                 self.slots, self.group_id)
        try:
            await self._commit_loop()
            await self._drain_all()
        finally:
            self._stopping.set()
            await asyncio.to_thread(self._consumer_done.wait)
            await heartbeat.stop()
            await self.executor.close()
            if server:
                server.shutdown()
            log.info("worker %s stopped", self.worker_id)

    def fail(self, reason: str) -> None:
        """Stop because this worker cannot make safe progress; it exits non-zero and health says why."""
        if self.failure is None:
            self.failure = reason
        self.stop()

    def health(self) -> dict[str, Any]:
        status = "failed" if self.failure else "stopping" if self._stopping.is_set() else (
            "ok" if self.ready.is_set() else "starting")
        return {"status": status, "reason": self.failure,
                "stage": self.stage.name, "worker": self.worker_id, "busy_slots": self._running,
                "slots": self.slots, "partitions": list(self._partition_ids)}

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

    # ---- consumer thread: commits -------------------------------------------------------------------------

    def _confirm_ownership(self, consumer: Consumer) -> None:
        """After a freeze: a synchronous commit of the current positions succeeds only for a member the group still
        counts (generation / member epoch checked by the coordinator). Success lets jobs start again. On a refusal
        nothing starts: a fenced member waits for the group to take its partitions (on_lost / on_revoke drop them
        with their stale backlog) and hand out new ones (on_assign); any other refusal (a coordinator moving, a
        broker restarting) is retried every second."""
        positions: list[TopicPartition] = self._call_in_loop(
            lambda: [commit_position(t, p, part.offsets) for (t, p), part in self._parts.items()], timeout=30)
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
            consumer.commit(offsets=owned, asynchronous=True)  # checked in _on_commit
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
        """Delivery report of an asynchronous commit: failures are counted and the positions sent again."""
        failed = [tp for tp in partitions if tp.error is not None] if err is None else partitions
        if not failed:
            return
        reason = str(err or failed[0].error)
        self.metrics.commit_failed(reason)
        log.warning("commit of %s failed: %s", [(t.topic, t.partition) for t in failed], reason)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._recommit, [(t.topic, t.partition) for t in failed])

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
                done = decode_done(start, tp.metadata)
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

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        final: list[TopicPartition] = self._call_in_loop(lambda: self._drain_partitions(tps),
                                                         timeout=self.grace_s + 30)
        if final:
            self._commit_owned(consumer, final, asynchronous=False)
        self._owned.difference_update(tps)  # from here on, no commit for them leaves this worker
        log.info("revoked %s", sorted(p for _, p in tps))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self._owned.difference_update(tps)
        self._call_in_loop(lambda: self._forget_partitions(tps), timeout=30)
        log.warning("lost %s", sorted(p for _, p in tps))

    # ---- event loop: partitions ---------------------------------------------------------------------------

    def _add_partitions(self, states: dict[TP, PartitionOffsets]) -> None:
        for tp, offsets in states.items():
            self._parts[tp] = _Partition(offsets)
            if tp not in self._rr:
                self._rr.append(tp)
        self._partition_ids = tuple(sorted(p for _, p in self._parts))

    async def _drain_partitions(self, tps: list[TP]) -> list[TopicPartition]:
        """Stop intake on ``tps``, give their running jobs the grace period, return their final offsets."""
        parts = {tp: self._parts[tp] for tp in tps if tp in self._parts}
        tasks: set[asyncio.Task[None]] = set()
        for part in parts.values():
            part.revoking = True
            part.backlog.clear()
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
        final = [commit_position(t, p, part.offsets) for (t, p), part in parts.items()]
        self._forget_partitions(tps)
        return final

    def _forget_partitions(self, tps: list[TP]) -> None:
        for tp in tps:
            part = self._parts.pop(tp, None)
            if part:
                for task in part.tasks:
                    task.cancel()
            self._dirty.discard(tp)
            self._last_commit.pop(tp, None)
            with contextlib.suppress(ValueError):
                self._rr.remove(tp)
        self._partition_ids = tuple(sorted(p for _, p in self._parts))

    async def _drain_all(self) -> None:
        """Graceful stop of the whole worker: no new jobs; running ones get the grace period; final commit."""
        final = await self._drain_partitions(list(self._parts))
        if final:
            self._commands.put(lambda c: self._commit_owned(c, final, asynchronous=False))
        self._commands.put(lambda c: self._final_committed.set())

    # ---- event loop: dispatch -----------------------------------------------------------------------------

    def _on_messages(self, msgs: list[Message]) -> None:
        to_pause: list[tuple[TP, _Partition]] = []
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
            part.backlog.append(msg)
            if not part.paused and len(part.backlog) >= self.prefetch:
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

    def _dispatch(self) -> None:
        if self._stopping.is_set():
            return
        if time.monotonic() - self._polled_at > FREEZE_S:
            self._unconfirmed.set()  # the loop resumed first: the consumer thread confirms before any start
        if self._unconfirmed.is_set():
            return
        idle_rounds = 0
        while self._running < self.slots and self._rr and idle_rounds < len(self._rr):
            tp = self._rr[0]
            self._rr.rotate(-1)
            part = self._parts.get(tp)
            msg = self._take(part) if part is not None else None
            if msg is None or part is None:
                idle_rounds += 1
                continue
            idle_rounds = 0
            self._running += 1
            part.running += 1
            self.metrics.busy_slots.set(self._running)
            if self.stage.spec.ordering == "keyed":
                self._busy_keys.add(msg.key())
            lane = self._budgeted_lane(msg)
            if lane is not None:
                self._lane_running[lane] += 1
            self._launch(tp, part, msg, lane)
            if part.paused and len(part.backlog) <= self.prefetch // 2:
                part.paused = False
                resume = [TopicPartition(*tp)]
                self._commands.put(lambda c, r=resume: c.resume(r))  # type: ignore[misc]

    def _take(self, part: _Partition) -> Message | None:
        if part.revoking or not part.backlog or part.running >= self.per_partition_cap:
            return None
        if part.offsets.map_full:
            # Back-pressure: its backlog fills and the partition pauses until the low jobs finish; only the lowest
            # unfinished job may start (in keyed mode it can still be waiting here, and the map waits for it).
            lowest = part.offsets.committable
            for i, msg in enumerate(part.backlog):
                if msg.offset() == lowest and self._startable(msg):
                    del part.backlog[i]
                    return msg
            return None
        if self.stage.spec.ordering != "keyed" and not self.lanes:
            return part.backlog.popleft()
        for i, msg in enumerate(part.backlog):
            if self._startable(msg):
                del part.backlog[i]
                return msg
        return None

    def _budgeted_lane(self, msg: Message) -> str | None:
        """The message's lane when this worker budgets it (``KILN_LANES``)."""
        if not self.lanes:
            return None
        lane = codec.lane_of(msg.headers())
        return lane if lane in self.lanes else None

    def _startable(self, msg: Message) -> bool:
        """Its key is not running (keyed stages) and its lane has a free slot in its budget."""
        if msg.key() in self._busy_keys:
            return False
        lane = self._budgeted_lane(msg)
        return lane is None or self._lane_running[lane] < self.lanes[lane]

    def _launch(self, tp: TP, part: _Partition, msg: Message, lane: str | None) -> None:
        """Start one job that holds a slot (counted by the caller)."""
        task = asyncio.get_running_loop().create_task(self._run_job(tp, part, msg, lane))
        part.tasks.add(task)

    async def _run_job(self, tp: TP, part: _Partition, msg: Message, lane: str | None) -> None:
        released = False

        def release_slot() -> None:
            # The slot frees when the handler is done; publishing its result is I/O that must not hold a slot.
            nonlocal released
            if released:
                return
            released = True
            self._running -= 1
            part.running -= 1
            if lane is not None:
                self._lane_running[lane] -= 1
            self.metrics.busy_slots.set(self._running)
            if self.stage.spec.ordering == "keyed":
                self._busy_keys.discard(msg.key())
            self._dispatch()

        try:
            await self.executor.process(msg, release_slot)
            part.offsets.finish(coordinates(msg)[2])
            self._dirty.add(tp)
            self._commit_wake.set()
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
            await asyncio.sleep(0.005)  # coalesce bursts of completions into one commit
            self._commit_dirty()

    def _commit_dirty(self) -> None:
        offsets: list[TopicPartition] = []
        for tp in list(self._dirty):
            part = self._parts.get(tp)
            if part is None or part.revoking:
                continue
            position = commit_position(tp[0], tp[1], part.offsets)
            state = (position.offset, position.metadata or "")
            if self._last_commit.get(tp) != state:
                self._last_commit[tp] = state
                offsets.append(position)
        self._dirty.clear()
        if offsets:
            self._commands.put(lambda c: self._commit_owned(c, offsets, asynchronous=True))
