"""The worker's producer: one idempotent librdkafka producer, a thread serving its delivery reports, and what a
failed delivery means (``delivery_error``). Results, events, dead letters and heartbeats all go through it; each
``produce`` returns once the broker has the record (acks=all)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from pydantic import BaseModel

from kiln.streams.errors import BlobUnavailable, BrokerUnavailable, DeliveryRefused, KilnError, NoDestination
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.settings import KilnSettings, producer_config

log = logging.getLogger("kiln.executor")
REPLY_ATTEMPTS = 4
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


def _shown(topic: str) -> str:
    return repr(topic if len(topic) <= 100 else f"{topic[:100]}... ({len(topic)} characters)")


def delivery_error(error: BaseException | KafkaError, topic: str) -> KilnError:
    """What a failed produce, delivery report or metadata lookup for ``topic`` means: ``BrokerUnavailable`` (retry
    later), ``DeliveryRefused`` (this record can never go there; ``NoDestination`` when the topic or partition
    does not exist). librdkafka raises
    ``KafkaException``, but also ``ValueError`` (a NUL byte in a name) and ``RuntimeError`` (a name it cannot make
    a topic of, e.g. 600 characters); anything that is no Kafka error refuses the record."""
    if isinstance(error, KafkaException) and error.args and isinstance(error.args[0], KafkaError):
        error = error.args[0]
    if isinstance(error, KafkaError):
        if error.code() in _NO_DESTINATION:
            return NoDestination(f"delivery to {_shown(topic)} refused: {error.str()}", topic)
        if error.code() in _UNAVAILABLE or error.retriable():
            return BrokerUnavailable(f"delivery to {_shown(topic)}: {error.str()}")
        return DeliveryRefused(f"delivery to {_shown(topic)} refused: {error.str()}")
    if isinstance(error, KilnError):
        return error
    return DeliveryRefused(f"delivery to {_shown(topic)} refused: {type(error).__name__}: {str(error)[:300]}")


def publish_records(settings: KilnSettings, topic: str, records: Iterable[tuple[str, BaseModel]], client_id: str,
                    timeout_s: float = 30.0) -> int:
    """Produce each ``(key, model)`` (its JSON) to ``topic`` (unprefixed) and return once the broker has every one
    (acks=all): for a tool that writes records outside a worker (``kiln verify rescore``, ``kiln tasks health``).
    Raises what the first undelivered record's failure means (``delivery_error``); returns how many were sent."""
    name = settings.topic(topic)
    producer = Producer(producer_config(settings, **{"client.id": client_id}))
    failed: list[KafkaError] = []

    def delivered(error: KafkaError | None, _msg: Message) -> None:
        if error is not None:
            failed.append(error)
    sent = 0
    try:
        for key, model in records:
            producer.produce(name, key=key.encode(), value=model.model_dump_json().encode(), on_delivery=delivered)
            producer.poll(0)
            sent += 1
    except (KafkaException, ValueError, RuntimeError) as e:
        producer.flush(timeout_s)
        raise delivery_error(e, name) from None
    left = producer.flush(timeout_s)
    if failed:
        raise delivery_error(failed[0], name)
    if left:
        raise BrokerUnavailable(f"delivery to {_shown(name)}: {left} of {sent} records not acknowledged in "
                                f"{timeout_s:g} s")
    return sent


def backoff(delay: float) -> float:
    return min(RETRY_MAX_S, delay * 2)


def _settle(batch: list[tuple[asyncio.Future[None], KilnError | None]]) -> None:
    for done, error in batch:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)


class WorkerProducer:
    """The producer of one worker (``start`` on the loop, ``close`` at the end) and the reply topics it has seen."""

    def __init__(self, settings: KilnSettings, metrics: WorkerMetrics, client_id: str) -> None:
        self.settings = settings
        self.metrics = metrics
        self.client_id = client_id
        self._producer: Producer | None = None
        self._topic_partitions: dict[str, int] = {}  # reply topics seen to exist, with their partition counts
        self._vanished: dict[str, float] = {}  # reply topics found missing, waited for: since when (monotonic)
        self._seen: set[str] = set()  # reply topics this worker has seen exist (a vanished one is waited for longer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = threading.Event()
        self._delivery_thread: threading.Thread | None = None
        # Delivery reports, filled by librdkafka callbacks in whichever thread polls, handed to the loop in batches:
        # one wake-up of the loop per poll, not one per record.
        self._settled: collections.deque[tuple[asyncio.Future[None], KilnError | None]] = collections.deque()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._producer = Producer(producer_config(self.settings, **{"client.id": self.client_id}))
        self._delivery_thread = threading.Thread(target=self._delivery_main, name="kiln-delivery", daemon=True)
        self._delivery_thread.start()

    async def close(self) -> None:
        """Flush outstanding records and stop the delivery thread."""
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
        except NoDestination:
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

    def destination_known(self, topic: str, partition: int | None) -> bool:
        """Already seen to exist (no coroutine per reply for the common case)."""
        count = self._topic_partitions.get(topic, 0)
        return count > 0 and (partition is None or partition < count)

    async def check_destination(self, topic: str, partition: int | None) -> None:
        """A reply's topic and partition exist (a request names them; a wrong one must fail fast, not after the
        producer's metadata timeout)."""
        count = await self.partitions(topic)
        if not count:
            raise NoDestination(f"reply topic {_shown(topic)} does not exist", topic)
        if partition is not None and partition >= count:
            raise DeliveryRefused(f"reply topic {_shown(topic)} has no partition {partition}")

    async def retrying(self, what: str, send: Callable[[], Awaitable[None]], blob_attempts: int = REPLY_ATTEMPTS,
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
            except NoDestination as e:
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
            delay = backoff(delay)
