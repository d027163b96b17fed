"""``kiln tail TOPIC``: decode the records of any kiln topic, newest first N then following, filtered by kind,
client or request id (a request's id, a result's, or the original of a dead letter)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, TopicPartition

from kiln.streams.errors import ConfigError
from kiln.streams.settings import KilnSettings
from kiln.streams.status.records import Record, decode


@dataclass(frozen=True)
class Filter:
    kind: str | None = None
    client: str | None = None
    request_id: str | None = None

    def __call__(self, record: Record) -> bool:
        f = record.fields
        return ((self.kind is None or f.get("kind") == self.kind)
                and (self.client is None or f.get("client") == self.client)
                and (self.request_id is None or self.request_id in (f.get("request_id"), f.get("redriven_from"))))


def tail(settings: KilnSettings, topic: str, *, last: int = 10, from_beginning: bool = False, follow: bool = False,
         keep: Callable[[Record], bool] = Filter(), stop: Callable[[], bool] = lambda: False) -> Iterator[Record]:
    """The records of ``topic`` (unprefixed) from ``last`` before each partition's end (or its start), matching
    ``keep``; with ``follow``, new ones until ``stop()``."""
    name = settings.topic(topic)
    consumer = Consumer(settings.kafka(**{"group.id": f"kiln-tail-{uuid.uuid4().hex[:8]}",
                                          "enable.auto.commit": False, "enable.partition.eof": True}))
    try:
        md = consumer.list_topics(name, timeout=15).topics.get(name)
        if md is None or md.error is not None:
            raise ConfigError(f"topic {name} does not exist")
        assignment, pending = [], set()
        for p in md.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=15)
            assignment.append(TopicPartition(name, p, low if from_beginning else max(low, high - last)))
            if high > (low if from_beginning else max(low, high - last)):
                pending.add(p)
        consumer.assign(assignment)
        while (pending or follow) and not stop():
            for msg in consumer.consume(200, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition() or 0)
                    continue
                record = decode(msg)
                if keep(record):
                    yield record
    finally:
        consumer.close()
