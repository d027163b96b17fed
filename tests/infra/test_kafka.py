"""The broker is a real Apache Kafka with share groups: produce, consume, commit; share-group consume."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, Producer, ShareConsumer, TopicPartition
from confluent_kafka.admin import (
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from kiln.streams import admin
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec


def _produce(settings: KilnSettings, topic: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "enable.idempotence": True})
    for i in range(n):
        producer.produce(topic, key=str(i).encode(), value=f"m{i}".encode())
    assert producer.flush(30) == 0


def test_produce_consume_commit(kafka: KilnSettings, unique: str) -> None:
    topic = f"t-commit-{unique}"
    admin.create_topics(kafka, [TopicSpec(topic, 2)])
    _produce(kafka, topic, 20)

    conf = {"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"g-{unique}",
            "auto.offset.reset": "earliest", "enable.auto.commit": False, "group.protocol": "consumer"}
    consumer = Consumer(conf)
    consumer.subscribe([topic])
    seen: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(seen) < 10 and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            seen.append(msg.value())
            consumer.commit(msg, asynchronous=False)
    committed = consumer.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)
    consumer.close()
    assert len(seen) == 10
    assert sum(max(tp.offset, 0) for tp in committed) == 10

    # A second member of the group resumes after the committed offsets: it sees exactly the other 10.
    rest = Consumer(conf)
    rest.subscribe([topic])
    more: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(more) < 10 and time.monotonic() < deadline:
        msg = rest.poll(0.5)
        if msg is not None and msg.error() is None:
            more.append(msg.value())
    rest.close()
    assert sorted(seen + more) == sorted(f"m{i}".encode() for i in range(20))


def test_share_group_consume(kafka: KilnSettings, unique: str) -> None:
    topic, group = f"t-share-{unique}", f"sg-{unique}"
    admin.create_topics(kafka, [TopicSpec(topic, 2)])
    client = admin.admin_client(kafka)
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=[
        ConfigEntry("share.auto.offset.reset", "earliest", incremental_operation=AlterConfigOpType.SET)])
    for fut in client.incremental_alter_configs([resource]).values():
        fut.result(15)
    _produce(kafka, topic, 12)

    consumer = ShareConsumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group,
                              "share.acknowledgement.mode": "explicit"})
    consumer.subscribe([topic])
    got: set[bytes] = set()
    deadline = time.monotonic() + 45
    while len(got) < 12 and time.monotonic() < deadline:
        for msg in consumer.poll(1.0) or []:
            if msg.error() is None:
                got.add(msg.value())
                consumer.acknowledge(msg)
        consumer.commit_sync(15)
    consumer.close()
    assert got == {f"m{i}".encode() for i in range(12)}


    # Accepted records are gone from the queue: a new member of the same share group acquires none of them. It reads
    # until it has a marker produced behind them on each partition (so it surely consumes both partitions, past
    # where the accepted records are): what it acquired is the two markers, nothing else.
    again = ShareConsumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group})
    again.subscribe([topic])
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for partition in (0, 1):
        producer.produce(topic, value=f"marker{partition}".encode(), partition=partition)
    assert producer.flush(30) == 0
    acquired: list[bytes] = []
    deadline = time.monotonic() + 45
    while not {b"marker0", b"marker1"} <= set(acquired) and time.monotonic() < deadline:
        acquired += [m.value() for m in again.poll(1.0) or [] if m.error() is None]
    again.close()
    assert sorted(acquired) == [b"marker0", b"marker1"]
