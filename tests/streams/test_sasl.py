"""A secured cluster: a worker and a trainer reach the broker through its SASL_PLAINTEXT (SCRAM-SHA-256) listener with
ACLs that let each do only its job (StandardAuthorizer, deny by default): each is refused the other's job, a principal
without ACLs is refused, and a wrong password does not authenticate."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
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


def _write(settings: KilnSettings, topic: str) -> KafkaError | None:
    """Produces one record to ``topic``; the delivery's error (None when the broker took it)."""
    producer = Producer(settings.kafka(**{"message.timeout.ms": 30000}))
    outcome: list[KafkaError | None] = []
    producer.produce(topic, b"not a job", on_delivery=lambda err, _msg: outcome.append(err))
    producer.flush(40)
    assert len(outcome) == 1, "no delivery report"
    return outcome[0]


def _read(settings: KilnSettings, topic: str, group: str) -> KafkaError | int:
    """Reads partition 0 of ``topic`` from the start in ``group`` (one the principal may use): the refusal's error,
    or how many records came once the partition's end was reached."""
    consumer = Consumer(settings.kafka(**{"group.id": group, "enable.auto.commit": False,
                                          "enable.partition.eof": True}))
    try:
        consumer.assign([TopicPartition(topic, 0, -2)])  # -2: the beginning
        records, deadline = 0, time.monotonic() + 60
        while time.monotonic() < deadline:
            message = consumer.poll(1)
            if message is None:
                continue
            error = message.error()
            if error is None:
                records += 1
            elif error.code() == KafkaError._PARTITION_EOF:
                return records
            else:
                return error
        raise AssertionError(f"neither a refusal nor the end of {topic} within 60 s")
    finally:
        consumer.close()


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
    requests, results_topic = (trainer_settings.topic(n) for n in ("echo.requests", "kiln.results"))
    trainer_group, worker_group = f"kiln-client.{user}", "g-echo.requests"
    # The same reads succeed for the role whose job they are (so a refusal below is the ACL's, not the helper's)...
    assert isinstance(_read(trainer_settings, results_topic, trainer_group), int)
    assert isinstance(_read(worker_settings, requests, worker_group), int)
    # ...and are refused, by the authorizer, to the other: a worker neither submits jobs nor reads results, a trainer
    # does not read the requests (its own or others').
    refused = KafkaError.TOPIC_AUTHORIZATION_FAILED
    for error in (_write(worker_settings, requests), _read(worker_settings, results_topic, worker_group),
                  _read(trainer_settings, requests, trainer_group), _write(trainer_settings, results_topic)):
        assert isinstance(error, KafkaError) and error.code() == refused, error
    # A principal with valid credentials but no ACLs is refused (deny by default).
    intruder = secured["intruder"]
    with pytest.raises(KilnError, match=r"(?i)authoriz"):
        async with KilnClient(intruder, str(intruder.kafka_config["sasl.username"])) as kiln:
            await asyncio.wait_for(kiln.call("echo", EchoRequest(data=1), key="x"), 60)


def test_a_wrong_password_does_not_authenticate(secured: dict[str, KilnSettings]) -> None:
    right = secured["worker"]
    wrong = right.model_copy(update={"kafka_config": {**right.kafka_config, "sasl.password": "not-the-password"}})
    admin.admin_client(right).list_topics(timeout=10)  # the right password does
    errors: list[KafkaError] = []
    producer = Producer(wrong.kafka(error_cb=errors.append))
    deadline = time.monotonic() + 30
    while not errors and time.monotonic() < deadline:
        producer.poll(0.5)
    assert errors and errors[0].code() == KafkaError._AUTHENTICATION, errors
    with pytest.raises(KafkaException):
        admin.admin_client(wrong).list_topics(timeout=5)
