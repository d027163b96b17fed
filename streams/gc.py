"""``kiln gc``: the blob store's garbage collector, mark and sweep, dry-run unless told to delete.

Mark: every digest a live record references — any 64-hex token (``sha256:`` or bare, conservatively) in the value
or headers of every record still retained on the deployment's topics (claim checks, dead-letter claim checks,
proof-state and snapshot handles, checkpoint and weight digests in results and events), in the commit metadata of
every consumer group on them (the trainer's checkpoint to restart from), in every name and name's
content (Saucer pointers, revision records, build cache entries, exec keys and snapshot grants), and, transitively,
inside every marked blob small enough to read (a Saucer manifest names its packs; a zstd claim check may carry
handles). Sweep: a blob nobody references and older than ``min_age`` (a blob written moments ago may be on its way
into a record) is removed. Names are never removed: they belong to the stage that wrote them. What each store keeps
and for how long: docs/architecture.md ("Retention").
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zstandard
from confluent_kafka import Consumer, TopicPartition

from kiln.streams.blobstore import BlobInfo, BlobStore
from kiln.streams.settings import KilnSettings

HEX = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
SCAN_LIMIT = 8 << 20
"""Marked blobs up to this size are read for further references (manifests, claim checks); bigger ones are data."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def references(data: bytes) -> set[str]:
    """Every digest ``data`` may name (zstd frames are looked into, up to ``SCAN_LIMIT`` decompressed)."""
    found = {f"sha256:{m.decode()}" for m in HEX.findall(data)}
    if data.startswith(ZSTD_MAGIC):
        try:
            with zstandard.ZstdDecompressor().stream_reader(data) as reader:
                found |= references(reader.read(SCAN_LIMIT))
        except zstandard.ZstdError:
            pass
    return found


def topic_references(settings: KilnSettings, topics: Iterable[str]) -> set[str]:
    """Digests referenced by any record still retained on ``topics`` (values and header values)."""
    consumer = Consumer(settings.kafka(**{"group.id": f"kiln-gc-{time.time_ns()}", "enable.auto.commit": False}))
    found: set[str] = set()
    try:
        for topic in topics:
            md = consumer.list_topics(topic, timeout=10).topics.get(topic)
            if md is None or md.error is not None:
                continue
            ends = {}
            for p in md.partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                if high > low:
                    ends[p] = (low, high)
            consumer.assign([TopicPartition(topic, p, low) for p, (low, _high) in ends.items()])
            while ends:
                for msg in consumer.consume(1000, 1.0):
                    if msg.error() is not None:
                        continue
                    found |= references(msg.value() or b"")
                    for header in msg.headers() or []:
                        value = header[1]
                        found |= references(value if isinstance(value, bytes) else str(value or "").encode())
                    offset, partition = msg.offset() or 0, msg.partition() or 0
                    if offset + 1 >= ends.get(partition, (0, 0))[1]:
                        ends.pop(partition, None)
            consumer.unassign()
    finally:
        consumer.close()
    return found


def group_references(settings: KilnSettings) -> set[str]:
    """Digests named in consumer groups' commit metadata (the trainer commits the checkpoint it restarts from)."""
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka())
    found: set[str] = set()
    listed = admin.list_consumer_groups(request_timeout=30).result()
    for group in (g.group_id for g in listed.valid):
        offsets = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                    request_timeout=30)[group].result()
        for tp in offsets.topic_partitions or []:
            if tp.topic.startswith(settings.topic_prefix) and tp.metadata:
                found |= references(tp.metadata.encode())
    return found


@dataclass
class GcReport:
    blobs: int = 0
    referenced: int = 0
    young: int = 0
    unreferenced: list[BlobInfo] = field(default_factory=list)
    removed: int = 0

    @property
    def unreferenced_bytes(self) -> int:
        return sum(b.size for b in self.unreferenced)


def mark(store: BlobStore, roots: set[str]) -> set[str]:
    """``roots`` plus every digest reachable from them and from the names."""
    live = set(roots)
    for name in store.all_names():
        live |= references(name.encode())
        live |= references(store.get_name(name))
    pending = list(live)
    while pending:
        digest = pending.pop()
        if not store.exists(digest):
            continue
        with store.open(digest) as stream:
            head = stream.read(SCAN_LIMIT + 1)
        if len(head) > SCAN_LIMIT:
            continue
        for found in references(head) - live:
            live.add(found)
            pending.append(found)
    return live


def collect(settings: KilnSettings, store: BlobStore, *, min_age_s: float, delete: bool,
            progress: Callable[[str], None] = lambda _m: None) -> GcReport:
    """Mark from every topic under the deployment's prefix and every name, then sweep (only if ``delete``)."""
    consumer = Consumer(settings.kafka(**{"group.id": "kiln-gc-list"}))
    try:
        topics = sorted(t for t in consumer.list_topics(timeout=10).topics
                        if t.startswith(settings.topic_prefix) and not t.startswith("__"))
    finally:
        consumer.close()
    progress(f"reading {len(topics)} topics")
    roots = topic_references(settings, topics) | group_references(settings)
    progress(f"{len(roots)} digests named by records; following names and blobs")
    live = mark(store, roots)
    report = GcReport()
    cutoff = time.time() - min_age_s
    for blob in store.blobs():
        report.blobs += 1
        if blob.digest in live:
            report.referenced += 1
        elif blob.modified > cutoff:
            report.young += 1
        else:
            report.unreferenced.append(blob)
    if delete:
        for blob in report.unreferenced:
            store.delete(blob.digest)
            report.removed += 1
    return report
