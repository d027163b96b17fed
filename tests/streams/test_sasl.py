"""A secured cluster: a worker and a trainer reach the broker through its SASL_PLAINTEXT (SCRAM-SHA-256) listener with
ACLs that let each do only its job (StandardAuthorizer, deny by default); a principal without them is refused."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)

from kiln.schemas.builtin import EchoRequest
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.errors import KilnError
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec

SASL = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256"}


def _through_sasl(kafka: KilnSettings, prefix: str, user: str, password: str) -> KilnSettings:
    port = int(kafka.bootstrap_servers.rsplit(":", 1)[1]) + 2  # infra/kafka/kafka.sh: the SASL listener
    return kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{port}", "topic_prefix": prefix,
                                    "kafka_config": {**SASL, "sasl.username": user, "sasl.password": password}})


def _allow(principal: str, kind: ResourceType, name: str, *operations: AclOperation) -> list[AclBinding]:
    return [AclBinding(kind, name, ResourcePatternType.LITERAL, f"User:{principal}", "*", op,
                       AclPermissionType.ALLOW) for op in operations]


def _wait_authenticated(settings: KilnSettings, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.admin_client(settings).list_topics(timeout=5)
            return
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def secured(kafka: KilnSettings, unique: str) -> Iterator[dict[str, KilnSettings]]:
    """Users worker-<u>, trainer-<u>, intruder-<u> (SCRAM), topics under a fresh prefix, and ACLs for the first two,
    made through the plaintext listener (the local super user)."""
    prefix = f"s{unique}."
    plain = kafka.model_copy(update={"topic_prefix": prefix})
    requests, results, dlq = (plain.topic(n) for n in ("echo.requests", "kiln.results", "echo.requests.dlq"))
    admin.create_topics(plain, [TopicSpec("echo.requests", 2), TopicSpec("echo.requests.dlq", 1),
                                TopicSpec("kiln.results", 2)])
    users = {role: f"{role}-{unique}" for role in ("worker", "trainer", "intruder")}
    passwords = {role: secrets.token_urlsafe(18) for role in users}
    client = admin.admin_client(kafka)
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 8192)
    for future in client.alter_user_scram_credentials(
            [UserScramCredentialUpsertion(users[r], info, passwords[r].encode()) for r in users]).values():
        future.result(30)
    worker, trainer = users["worker"], users["trainer"]
    acls = [*_allow(worker, ResourceType.TOPIC, requests, AclOperation.READ, AclOperation.DESCRIBE),
            *_allow(worker, ResourceType.TOPIC, results, AclOperation.WRITE, AclOperation.DESCRIBE),
            *_allow(worker, ResourceType.TOPIC, dlq, AclOperation.WRITE, AclOperation.DESCRIBE),
            *_allow(worker, ResourceType.GROUP, "g-echo.requests", AclOperation.READ),  # WorkerProcess's group
            *_allow(trainer, ResourceType.TOPIC, requests, AclOperation.WRITE, AclOperation.DESCRIBE),
            *_allow(trainer, ResourceType.TOPIC, results, AclOperation.READ, AclOperation.DESCRIBE),
            *_allow(trainer, ResourceType.GROUP, f"kiln-client.{trainer}", AclOperation.READ)]
    for future in client.create_acls(acls).values():
        future.result(30)
    secured = {role: _through_sasl(kafka, prefix, users[role], passwords[role]) for role in users}
    for settings in secured.values():  # new credentials take a moment to reach the listener
        _wait_authenticated(settings)
    yield secured
    filters = [AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation,
                                b.permission_type) for b in acls]
    for future in client.delete_acls(filters).values():
        future.result(30)
    for future in client.alter_user_scram_credentials(
            [UserScramCredentialDeletion(u, ScramMechanism.SCRAM_SHA_256) for u in users.values()]).values():
        future.result(30)
    admin.delete_topics(plain, [requests, results, dlq])


async def test_worker_and_trainer_work_through_sasl_with_only_their_acls(secured: dict[str, KilnSettings]) -> None:
    worker_settings, trainer_settings = secured["worker"], secured["trainer"]
    env = {"KILN_TOPIC_PREFIX": worker_settings.topic_prefix,
           "KILN_KAFKA_CONFIG": json.dumps(worker_settings.kafka_config)}
    with WorkerProcess("echo", worker_settings, "echo.requests", slots=2, env=env) as worker:
        worker.wait_assigned()
        user = str(trainer_settings.kafka_config["sasl.username"])
        async with KilnClient(trainer_settings, user) as kiln:
            results = [await kiln.call("echo", EchoRequest(data=i), key=str(i)) for i in range(5)]
        assert [r.data for r in results] == list(range(5))
    # A principal with valid credentials but no ACLs is refused (deny by default).
    intruder = secured["intruder"]
    with pytest.raises(KilnError, match=r"(?i)authoriz"):
        async with KilnClient(intruder, str(intruder.kafka_config["sasl.username"])) as kiln:
            await asyncio.wait_for(kiln.call("echo", EchoRequest(data=1), key="x"), 60)
