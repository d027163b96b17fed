"""Queue length from the broker alone, so it is known with zero workers: per partition, the log end offset minus
the group's committed offset minus the jobs finished ahead of it (recorded in the commit metadata by the runtime,
``streams/offsets.py``). A partition the group never committed counts from its log start."""

from __future__ import annotations

import logging

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from kiln.streams.errors import OffsetMapError
from kiln.streams.offsets import decode_done

log = logging.getLogger("kiln.stats")
TIMEOUT_S = 10.0
LATEST = OffsetSpec.latest()  # type: ignore[no-untyped-call]
EARLIEST = OffsetSpec.earliest()  # type: ignore[no-untyped-call]


def queue_length(admin: AdminClient, topic: str, group: str) -> int | None:
    """Unfinished records of ``topic`` for consumer group ``group``; None if the topic does not exist or the broker
    did not answer."""
    try:
        md = admin.list_topics(topic, timeout=TIMEOUT_S).topics.get(topic)
        if md is None or md.error is not None or not md.partitions:
            return None
        parts = [TopicPartition(topic, p) for p in sorted(md.partitions)]
        ends = admin.list_offsets({tp: LATEST for tp in parts}, request_timeout=TIMEOUT_S)
        starts = admin.list_offsets({tp: EARLIEST for tp in parts}, request_timeout=TIMEOUT_S)
        committed_future = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group, parts)], request_timeout=TIMEOUT_S)[group]
        committed = {(tp.topic, tp.partition): tp for tp in committed_future.result().topic_partitions}
        total = 0
        for tp in parts:
            end = ends[tp].result().offset
            start = starts[tp].result().offset
            mine = committed.get((topic, tp.partition))
            base = mine.offset if mine is not None and mine.offset >= 0 else start
            try:
                ahead = len(decode_done(base, mine.metadata if mine is not None else None))
            except OffsetMapError:
                ahead = 0
            total += max(0, end - max(base, start) - ahead)
        return total
    except Exception as e:  # the broker away or the group unknown: no number rather than a wrong one
        log.warning("queue length of %s for %s: %r", topic, group, e)
        return None
