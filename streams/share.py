"""Queue mode: a stage consumed through a Kafka share group (KIP-932), a true global queue for short jobs.

Any idle slot of any worker takes the next record, whatever its partition, so workers of different sizes share
the load by their slot counts. Apache Kafka >= 4.2 only (Redpanda has no share groups).

confluent-kafka's ``ShareConsumer`` is synchronous, must acknowledge a poll's records before the next poll, cannot
pause, and holds each acquired record under a lock (30 s by default) that it cannot renew. So: two consumers per
slot, each in its own thread asking for one record per poll, and a FIFO gate of ``slots`` on the event loop
around the handler (``LoopSlots``):
while one consumer's job runs, the other's record is already fetched, and publishing a result and the next
ShareFetch round trip never leave the slot idle. A worker thus holds at most one waiting record per slot, so load
still follows slot counts across workers. The job itself runs on the event loop through the same ``JobExecutor``
as group mode. Acknowledgements: ACCEPT when the job finished (result published), REJECT when it
was dead-lettered, RELEASE when it cannot run now (shutdown, a record beyond the first of a poll, a grace period
that ran out). A record delivered ``refuse_at`` times (e.g. one that crashes its worker) is dead-lettered with
that reason and rejected instead of being run again. The delivery count is a loose crash counter: when a process
dies, the record one consumer held is acquired at once for a sibling consumer's pending fetch in the same dead
process, so one crash often spends two deliveries, sometimes more; and the broker archives a record silently at
its own limit. So ``refuse_at`` is half the broker's limit, and kiln's broker runs with the maximum limit (10);
with the broker default (5) a worker warns, since a once-preempted job could then be dead-lettered. A stage
whose worst case (waiting for a slot, then timeout x attempts) does not fit in the lock is refused at start: it
would be redelivered while still running; and a record that waited so long that its own worst case no longer fits in
what is left of its lock is released unrun rather than started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from confluent_kafka import AcknowledgeType, Message, ShareConsumer
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from kiln.schemas.envelope import ErrorInfo
from kiln.streams import admin
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import ConfigError
from kiln.streams.lifecycle import WorkerLifecycle
from kiln.streams.middleware import Middleware, RetryMiddleware
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import Stage

log = logging.getLogger("kiln.share")

DEFAULT_LOCK_MS = 30_000
DEFAULT_DELIVERY_LIMIT = 5


def share_group_settings(settings: KilnSettings, group_id: str) -> tuple[float, int]:
    """Make the share group start at the earliest offset (requests queued before any worker existed must run) and
    return its record lock duration (s) and delivery-count limit, as the broker will apply them."""
    if not admin.broker_features(settings).share_groups:
        raise ConfigError(f"the broker at {settings.bootstrap_servers} has no share groups (KIP-932): queue mode "
                          "needs Apache Kafka >= 4.2 with share.version=1; use group mode (Redpanda)")
    client = admin.admin_client(settings)
    group = ConfigResource(ResourceType.GROUP, group_id, incremental_configs=[
        ConfigEntry("share.auto.offset.reset", "earliest", incremental_operation=AlterConfigOpType.SET)])
    for fut in client.incremental_alter_configs([group]).values():
        fut.result(15)
    lock_ms, limit = DEFAULT_LOCK_MS, DEFAULT_DELIVERY_LIMIT
    brokers = list(client.list_topics(timeout=15).brokers)
    if brokers:
        described = client.describe_configs([ConfigResource(ResourceType.BROKER, str(brokers[0]))])
        for fut in described.values():
            entries = fut.result(15)
            lock_ms = int(entries["group.share.record.lock.duration.ms"].value or lock_ms)
            limit = int(entries["group.share.delivery.count.limit"].value or limit)
    for fut in client.describe_configs([ConfigResource(ResourceType.GROUP, group_id)]).values():
        entries = fut.result(15)
        if "share.record.lock.duration.ms" in entries and entries["share.record.lock.duration.ms"].value:
            lock_ms = int(entries["share.record.lock.duration.ms"].value)
        if "share.delivery.count.limit" in entries and entries["share.delivery.count.limit"].value:
            limit = int(entries["share.delivery.count.limit"].value)
    return lock_ms / 1000, limit


def worst_case_job_s(stage: Stage, settings: KilnSettings) -> float | None:
    """Longest a record can stay acquired: waiting for a slot, then every attempt timing out, with backoff."""
    timeout = settings.job_timeout_s or stage.job_timeout_s
    if timeout is None:
        return None
    attempts = max(1, stage.max_attempts)
    per_job = timeout * attempts + RetryMiddleware().total_backoff_s(attempts)
    return 2 * per_job  # a record may first wait for its slot while the job before it runs


class LoopSlots:
    """``n`` job slots on the event loop, handed out in arrival order. Records wait here, on the loop, rather than
    in their consumer threads: a finishing job hands its slot straight to the oldest waiting record in the same loop
    iteration, with no thread wake-up between one job's end and the next one's start. (FIFO, so a record waits
    behind at most the jobs running when it arrived and cannot be overtaken until its lock runs out.)"""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiting: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed a slot just as the wait was given up: pass it on
            elif turn in self._waiting:  # (a release may already have dropped the cancelled turn)
                self._waiting.remove(turn)
            raise

    def release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot goes straight to the oldest waiter
                return
        self._free += 1


def may_start(polled_at: float, now: float, lock_s: float, job_s: float | None) -> bool:
    """Whether a record acquired at ``polled_at`` can still run to its end (``job_s``: its worst case) inside its
    lock; otherwise it is released unrun, since the broker may already have given it to another consumer."""
    return job_s is not None and (now - polled_at) + job_s < lock_s


class ShareWorker(WorkerLifecycle):
    """Runs ``stage`` from a share group with one ``ShareConsumer`` per slot, until ``stop()`` or SIGTERM."""

    mode = "queue"
    log = log

    def __init__(self, stage: Stage, settings: KilnSettings, *, slots: int | None = None,
                 group_id: str | None = None, topic: str | None = None, grace_s: float | None = None,
                 middleware: Sequence[Middleware] | None = None, blob_store: BlobStore | None = None,
                 worker_id: str | None = None) -> None:
        super().__init__(stage, settings, slots=slots, topic=topic, group_id=group_id or f"kiln.{stage.name}.queue",
                         grace_s=grace_s, middleware=middleware, blob_store=blob_store, worker_id=worker_id)
        self._stopped: asyncio.Event | None = None
        self._threads: list[threading.Thread] = []
        self._busy = 0
        self._busy_lock = threading.Lock()
        self._slots = LoopSlots(self.slots)
        self._polled = 0
        self.lock_s, self.delivery_limit = float(DEFAULT_LOCK_MS / 1000), DEFAULT_DELIVERY_LIMIT
        self.refuse_at = max(2, self.delivery_limit // 2)

    def _wake(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    def _health_details(self) -> dict[str, Any]:
        return {"mode": "queue", "busy_slots": self._busy, "slots": self.slots}

    def check(self) -> None:
        """Refuse what queue mode cannot do safely, with the reason (raises ConfigError)."""
        self.lock_s, self.delivery_limit = share_group_settings(self.settings, self.group_id)
        self.refuse_at = max(2, self.delivery_limit // 2)
        if self.delivery_limit < 10:
            log.warning("broker group.share.delivery.count.limit is %d: set it to 10 so that a job whose worker "
                        "was preempted is not mistaken for poison", self.delivery_limit)
        worst = worst_case_job_s(self.stage, self.settings)
        if worst is None or worst >= self.lock_s:
            shown = "unbounded" if worst is None else f"{worst:g} s"
            raise ConfigError(
                f"stage {self.stage.name!r}: a record may stay acquired for {shown} (waiting for a slot behind one "
                "job, then its own timeout x attempts + backoff), longer than the share group's record lock of "
                f"{self.lock_s:g} s, so it would be redelivered while still running. Use group mode for long jobs, "
                f"or set KILN_JOB_TIMEOUT_S so that 2 x timeout x {self.stage.max_attempts} attempts fits in the lock.")

    async def _prepare(self) -> None:
        self._stopped = asyncio.Event()
        if self._stopping.is_set():
            self._stopped.set()
        await asyncio.to_thread(self.check)

    def _start_consuming(self) -> None:
        self._threads = [threading.Thread(target=self._consumer_main, args=(i,), name=f"kiln-share-{i}", daemon=True)
                         for i in range(2 * self.slots)]
        for t in self._threads:
            t.start()
        if self.topic not in {self.settings.topic(t) for t in self.settings.queue_topics}:
            log.warning("%s is not in KILN_QUEUE_TOPICS: clients that batch its requests hand whole batches to "
                        "one slot", self.topic)
        log.info("worker %s: stage %s on %s in queue mode (%d slots, share group %s, lock %gs, dead-letter at "
                 "delivery %d of the broker's %d)", self.worker_id, self.stage.name, self.topic, self.slots,
                 self.group_id, self.lock_s, self.refuse_at, self.delivery_limit)

    async def _serve(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    async def _stop_consuming(self) -> None:
        for t in self._threads:
            await asyncio.to_thread(t.join, self.grace_s + 15)

    def _set_busy(self, delta: int) -> None:
        with self._busy_lock:
            self._busy += delta
            self.metrics.busy_slots.set(self._busy)

    def _consumer_main(self, index: int) -> None:
        consumer = ShareConsumer(self.settings.kafka(**{
            "group.id": self.group_id,
            "client.id": f"{self.worker_id}-{index}",
            "share.acknowledgement.mode": "explicit",
            "max.poll.records": 1,
        }))
        consumer.subscribe([self.topic])
        try:
            while not self._stopping.is_set():
                msgs = consumer.poll(0.2)
                with self._busy_lock:
                    self._polled += 1
                    if self._polled >= 2 * self.slots:
                        self.ready.set()
                if not msgs:
                    continue
                polled_at = time.monotonic()
                for i, msg in enumerate(msgs):
                    if msg.error() is not None:
                        continue
                    consumer.acknowledge(msg, self._settle(msg, first=i == 0, polled_at=polled_at))
                # The acknowledgements ride on the next poll's ShareFetch: no extra round trip per job.
        except Exception as e:
            log.exception("share consumer %d failed", index)
            self.fail(f"share consumer {index} failed: {e!r}")
        finally:
            try:
                consumer.close()
            except Exception as e:
                log.warning("closing share consumer %d: %s", index, e)

    def _settle(self, msg: Message, *, first: bool, polled_at: float) -> AcknowledgeType:
        """Run (or refuse) one acquired record and say how to acknowledge it."""
        assert self._loop is not None
        if self._stopping.is_set() or (not first and time.monotonic() - polled_at > self.lock_s / 4):
            return AcknowledgeType.RELEASE
        log.debug("acquired %s[%s]@%s (delivery %s)", msg.topic(), msg.partition(), msg.offset(), msg.delivery_count())
        if (msg.delivery_count() or 1) >= self.refuse_at:
            error = ErrorInfo(type="DeliveryLimitExceeded",
                              message=f"delivered {msg.delivery_count()} times without finishing (the job may "
                                      "crash or hang its worker); not run again")
            asyncio.run_coroutine_threadsafe(self._refuse(msg, error), self._loop).result(60)
            return AcknowledgeType.REJECT
        turn_taken = [False]
        job = asyncio.run_coroutine_threadsafe(self._run_in_turn(msg, polled_at, turn_taken), self._loop)
        try:
            while True:
                try:
                    return job.result(timeout=0.2)
                except concurrent.futures.TimeoutError:
                    if not self._stopping.is_set():
                        continue
                    if not turn_taken[0]:  # still waiting for a slot: give the record back unrun
                        job.cancel()
                        return AcknowledgeType.RELEASE
                    if not self._finish_within_grace(job):
                        return AcknowledgeType.RELEASE
        except Exception:
            log.exception("job from %s[%s]@%s could not be completed", msg.topic(), msg.partition(), msg.offset())
            return AcknowledgeType.RELEASE

    async def _run_in_turn(self, msg: Message, polled_at: float, turn_taken: list[bool]) -> AcknowledgeType:
        """(Event loop.) Wait for a slot in turn, then run the record's job; how to acknowledge it."""
        await self._slots.acquire()
        turn_taken[0] = True
        worst = worst_case_job_s(self.stage, self.settings)
        if self._stopping.is_set() or not may_start(polled_at, time.monotonic(), self.lock_s,
                                                    None if worst is None else worst / 2):
            self._slots.release()
            if not self._stopping.is_set():
                self.metrics.lock_expired.inc()
                log.warning("released %s[%s]@%s unrun: it waited %.1f s for a slot and could outlive its %g s "
                            "lock", msg.topic(), msg.partition(), msg.offset(), time.monotonic() - polled_at,
                            self.lock_s)
            return AcknowledgeType.RELEASE
        self._set_busy(+1)
        released = False

        def release_slot() -> None:
            nonlocal released
            if not released:
                released = True
                self._set_busy(-1)
                self._slots.release()

        try:
            outcome = await self.executor.process(msg, release_slot)
        finally:
            release_slot()
        if outcome is None or outcome.dead_letter:
            return AcknowledgeType.REJECT
        return AcknowledgeType.ACCEPT

    async def _refuse(self, msg: Message, error: ErrorInfo) -> None:
        await self.executor.dead_letters.write(msg, error, msg.delivery_count() or 0)
        await self.executor.reply_error(msg, error)

    def _finish_within_grace(self, job: concurrent.futures.Future[Any]) -> bool:
        """On shutdown: give the running job the grace period; cancel it when that runs out."""
        try:
            job.result(timeout=self.grace_s)
            return True
        except concurrent.futures.TimeoutError:
            job.cancel()
            return False
        except Exception:
            return True
