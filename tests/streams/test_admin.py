"""Topic topology on the real broker, and the broker feature probe."""

from __future__ import annotations

import socket

import pytest
from confluent_kafka.admin import ConfigResource, ResourceType

from kiln.streams import admin
from kiln.streams.errors import InfraError
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import topology


def test_stage_topics_are_created_with_their_partitions_and_retention(kafka: KilnSettings, unique: str) -> None:
    settings = kafka.model_copy(update={"topic_prefix": f"t{unique}."})
    first = admin.create_topics(settings)
    assert set(first.values()) == {"created"} and len(first) == len(topology())
    assert set(admin.create_topics(settings).values()) == {"exists"}  # idempotent

    client = admin.admin_client(settings)
    md = client.list_topics(timeout=10).topics
    for spec in topology():
        assert len(md[settings.topic(spec.name)].partitions) == spec.partitions
    configs = client.describe_configs([ConfigResource(ResourceType.TOPIC, settings.topic("repo.ingest")),
                                       ConfigResource(ResourceType.TOPIC, settings.topic("exec.requests.dlq"))])
    for fut in configs.values():
        entries = fut.result(10)
        assert entries["retention.ms"].value == "-1"  # replayed to rebuild state / kept as evidence


def test_broker_features_are_probed(kafka: KilnSettings) -> None:
    features = admin.broker_features(kafka)
    assert admin.CONSUMER_GROUP_HEARTBEAT_API in features.api_keys
    assert features.finalized["share.version"] == 1 and features.share_groups
    assert admin.resolve_group_protocol(kafka) == "consumer"
    assert admin.resolve_group_protocol(kafka.model_copy(update={"group_protocol": "classic"})) == "classic"


def test_broker_features_skip_a_bootstrap_server_that_is_down(kafka: KilnSettings) -> None:
    """A cluster with its first listed broker down (restarting, lost) still answers the probe; only when every
    bootstrap server fails is it an infrastructure error naming each."""
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    first_down = kafka.model_copy(update={"bootstrap_servers": f"{dead},{kafka.bootstrap_servers}"})
    features = admin.broker_features(first_down)
    assert admin.CONSUMER_GROUP_HEARTBEAT_API in features.api_keys
    with pytest.raises(InfraError) as failed:
        admin.broker_features(kafka.model_copy(update={"bootstrap_servers": f"{dead},{dead}"}), timeout=2)
    assert str(failed.value).count(dead) >= 3  # the list, then each server's failure
