"""The garbage collector on a real broker and both blob stores: what a retained record, a name or a live blob
references survives; an orphan is reported by the dry run, removed only with delete, and only once it is old."""

from __future__ import annotations

import json
import time
from pathlib import Path

import zstandard
from confluent_kafka import Consumer, Producer, TopicPartition

from kiln.schemas.envelope import RequestEnvelope
from kiln.streams import admin, codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.gc import collect
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec


def test_only_what_nothing_references_is_collected(kafka: KilnSettings, store: BlobStore, unique: str,
                                                   tmp_path: Path) -> None:
    settings = kafka.model_copy(update={"topic_prefix": f"t{unique}.", "cache": tmp_path / "cache"})
    admin.create_topics(settings, [TopicSpec("sleep.requests", 2), TopicSpec("sleep.requests.dlq", 1)])
    try:
        # A claim check in a request record, and one in a dead letter's header.
        envelope = RequestEnvelope(kind="sleep", client_id="c", payload={"pad": "x" * 5000})
        claimed = codec.encode(envelope, store, threshold=100)
        claim = json.loads(claimed)["claim_check"]["digest"]
        dead = store.put(b"a poison record's body").digest
        producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
        producer.produce(settings.topic("sleep.requests"), claimed)
        producer.produce(settings.topic("sleep.requests.dlq"), b"", headers=[("kiln-dlq-claim-check", dead.encode())])
        producer.flush(10)
        # A name pointing at a manifest that names a pack; a name whose path carries a bare digest (a grant).
        pack = store.put(b"PACK" * 100).digest
        manifest = store.put(json.dumps({"packs": [pack]}).encode()).digest
        store.set_name(f"saucer/{unique}", json.dumps({"manifest": manifest}).encode())
        granted = store.put(b"a session snapshot").digest
        store.set_name(f"exec/snapshots/{granted.removeprefix('sha256:')}/s1", b"")
        # A zstd claim check whose content holds a proof-state handle: the handle lives through it.
        handle = store.put(b"a proof state").digest
        store.set_name(f"results/{unique}", store.put(zstandard.ZstdCompressor().compress(
            json.dumps({"state": handle}).encode())).digest.encode())
        # A checkpoint named only by a consumer group's commit metadata (how the trainer finds its restart point).
        checkpoint = store.put(b"weights + optimizer").digest
        group = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"trainer-{unique}"})
        group.commit(offsets=[TopicPartition(settings.topic("sleep.requests"), 0, 1, checkpoint)],
                     asynchronous=False)
        group.close()
        orphan = store.put(b"nobody names me").digest
        live = [claim, dead, pack, manifest, granted, handle, checkpoint]

        young = collect(settings, store, min_age_s=3600, delete=True)
        assert young.unreferenced == [] and young.young >= 1 and store.exists(orphan)  # too young to go

        dry = collect(settings, store, min_age_s=0, delete=False)
        assert [b.digest for b in dry.unreferenced] == [orphan] and dry.removed == 0 and store.exists(orphan)

        swept = collect(settings, store, min_age_s=0, delete=True)
        assert swept.removed == 1 and not store.exists(orphan)
        assert all(store.exists(d) for d in live)
        assert collect(settings, store, min_age_s=0, delete=True).removed == 0
    finally:
        admin.delete_topics(settings, [settings.topic("sleep.requests"), settings.topic("sleep.requests.dlq")])


def test_writing_a_blob_again_makes_it_young(store: BlobStore) -> None:
    digest = store.put(b"same bytes twice").digest
    first = next(b.modified for b in store.blobs() if b.digest == digest)
    time.sleep(1.1)
    store.put(b"same bytes twice")
    assert next(b.modified for b in store.blobs() if b.digest == digest) > first
