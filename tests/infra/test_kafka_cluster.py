"""A replicated Kafka cluster (`KILN_KAFKA_BROKERS=3 kiln broker start`): three KRaft nodes, each broker and
controller voter, with replication 3 and min.insync.replicas 2 by default; `kiln topics create` takes those from the
cluster it finds and refuses replication 1 there unless told to."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import ConfigResource, NewTopic, ResourceType

from kiln.schemas.builtin import EchoRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.infra import infra_dir
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import echo
from tests.streams.harness import committed, running_worker

BASE_PORT = 29192  # nodes on 29192, 29202, 29212 (+1 controller, +2 SASL each): beside the suite's broker on 9092
CLUSTER_ENV = {"KILN_KAFKA_PORT": str(BASE_PORT), "KILN_KAFKA_BROKERS": "3"}


def kafka_sh(*args: str) -> str:
    return subprocess.run(["bash", str(infra_dir() / "kafka" / "kafka.sh"), *args], env={**os.environ, **CLUSTER_ENV},
                          capture_output=True, text=True, check=True, timeout=600).stdout


@pytest.fixture(scope="module")
def cluster() -> Iterator[KilnSettings]:
    kafka_sh("start")
    settings = KilnSettings(bootstrap_servers=kafka_sh("bootstrap").strip())
    try:
        assert admin.wait_for_broker(settings) == 3
        yield settings
    finally:
        kafka_sh("stop")


def kiln(settings: KilnSettings, prefix: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln.streams.cli", *args], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "KILN_BOOTSTRAP_SERVERS":
                                                         settings.bootstrap_servers, "KILN_TOPIC_PREFIX": prefix,
                                                         **env})


def test_the_cluster_replicates_its_internal_topics(cluster: KilnSettings) -> None:
    client = admin.admin_client(cluster)
    broker = ConfigResource(ResourceType.BROKER, "1")
    configs = client.describe_configs([broker])[broker].result(30)
    assert {k: configs[k].value for k in ("default.replication.factor", "min.insync.replicas",
                                           "offsets.topic.replication.factor", "unclean.leader.election.enable",
                                           "group.consumer.heartbeat.interval.ms")} \
        == {"default.replication.factor": "3", "min.insync.replicas": "2", "offsets.topic.replication.factor": "3",
            "unclean.leader.election.enable": "false", "group.consumer.heartbeat.interval.ms": "3000"}
    pids = kafka_sh("pids").split()
    assert len(pids) == 6 and pids[0::2] == ["1", "2", "3"]


def test_a_second_start_finds_the_cluster_running(cluster: KilnSettings) -> None:
    """`kafka.sh start` on a running cluster returns (a test session's `kiln setup kafka`): no node inherited the
    start lock's descriptor, which it would hold for life, so every later start would wait for ever."""
    pids = [int(pid) for pid in kafka_sh("pids").split()[1::2]]
    held = [link for pid in pids for fd in Path(f"/proc/{pid}/fd").iterdir()
            if (link := os.readlink(fd)).endswith(".start.lock")]
    assert not held
    again = subprocess.run(["bash", str(infra_dir() / "kafka" / "kafka.sh"), "start"], capture_output=True, text=True,
                           env={**os.environ, **CLUSTER_ENV}, check=True, timeout=120)
    assert again.stderr.count("already running") == 3


def test_topics_create_takes_replication_from_the_cluster_and_refuses_replication_1(cluster: KilnSettings) -> None:
    prefix, unsafe = f"c{uuid.uuid4().hex[:8]}.", f"u{uuid.uuid4().hex[:8]}."
    client = admin.admin_client(cluster)
    try:
        created = kiln(cluster, prefix, "topics", "create")
        assert created.returncode == 0, created.stderr
        assert "replication 3, min.insync.replicas 2, 3 brokers" in " ".join(created.stdout.split())
        ours = {name: t for name, t in client.list_topics(timeout=30).topics.items() if name.startswith(prefix)}
        assert len(ours) > 10
        assert {len(p.replicas) for t in ours.values() for p in t.partitions.values()} == {3}
        resources = [ConfigResource(ResourceType.TOPIC, name) for name in ours]
        insync = {r.name: f.result(30)["min.insync.replicas"].value
                  for r, f in client.describe_configs(resources).items()}
        assert set(insync.values()) == {"2"}, insync

        refused = kiln(cluster, unsafe, "topics", "create", KILN_TOPIC_REPLICATION="1")
        assert refused.returncode != 0
        assert "refusing to create topics with replication 1" in " ".join(refused.stderr.split())
        assert not [n for n in client.list_topics(timeout=30).topics if n.startswith(unsafe)]
        told = kiln(cluster, unsafe, "topics", "create", "--allow-unsafe-replication", KILN_TOPIC_REPLICATION="1")
        assert told.returncode == 0, told.stderr
        replicas = {len(p.replicas) for n, t in client.list_topics(timeout=30).topics.items() if n.startswith(unsafe)
                    for p in t.partitions.values()}
        assert replicas == {1}
    finally:
        admin.delete_topics(cluster, [n for n in client.list_topics(timeout=30).topics
                                      if n.startswith((prefix, unsafe))])


def test_a_single_broker_is_not_refused(kafka: KilnSettings) -> None:
    durability = admin.cluster_durability(kafka)
    assert (durability.brokers, durability.replication, durability.can_lose_acknowledged_writes) == (1, 1, False)


async def test_offset_commits_wait_for_each_other_while_the_offsets_log_is_slow(cluster: KilnSettings,
                                                                                unique: str) -> None:
    """A worker keeps at most one offset commit in flight. The coordinator answers a connection's requests one at a
    time, each once the offsets log has it in sync; while that write is slower than the commit interval (here one of
    its followers paused, shorter than the broker session, so nothing is fenced; on a loaded machine, any slow
    broker) commits sent every few ms queued up on the coordinator's connection, the group heartbeat behind them
    timed out (librdkafka's timeout for it is the heartbeat interval, 1 s), and commits failed by the hundred while
    members were fenced and their finished jobs run again. The job's own topics live on the other two nodes, so
    jobs keep finishing during the pause."""
    request, results = f"req-{unique}", f"res-{unique}"
    client_admin = admin.admin_client(cluster)
    group = f"g-{request}"
    pids = kafka_sh("pids").split()
    coordinator = admin.group_coordinator(client_admin, group)
    paused = next(n for n in (3, 2, 1) if n != coordinator)  # a follower of the group's offsets partition
    pid = int(dict(zip(pids[0::2], pids[1::2], strict=True))[str(paused)])
    others = [n for n in (1, 2, 3) if n != paused]
    for future in client_admin.create_topics([NewTopic(request, 2, replica_assignment=[others, others[::-1]]),
                                              NewTopic(results, 1, replica_assignment=[others])]).values():
        future.result(30)
    try:
        async with running_worker(echo.stage, cluster, request, slots=4) as worker, \
                KilnClient(cluster, f"c-{unique}", results_topic=results) as kiln:
            futures: list[asyncio.Future[ResultEnvelope]] = []
            pause_at = time.monotonic() + 2
            while time.monotonic() < pause_at + 8:
                futures.append(await kiln.submit("echo", EchoRequest(data=len(futures)), topic=request,
                                                 partition=len(futures) % 2))
                if pid and time.monotonic() >= pause_at:
                    os.kill(pid, signal.SIGSTOP)
                    paused_pid, pid = pid, 0
                    asyncio.get_running_loop().call_later(5, os.kill, paused_pid, signal.SIGCONT)
                await asyncio.sleep(0.01)
            await asyncio.wait_for(asyncio.gather(*futures), 60)
            failures = sum(sample.value for metric in worker.metrics.commit_failures.collect()
                           for sample in metric.samples if sample.name.endswith("_total"))
            assert failures <= 3, f"{failures:g} offset commits failed"
            per_partition = [len(futures[p::2]) for p in (0, 1)]
            deadline = time.monotonic() + 30
            while [committed(cluster, group, request, p) for p in (0, 1)] != per_partition:
                assert time.monotonic() < deadline, "the positions that waited were never all committed"
                await asyncio.sleep(0.2)
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        admin.delete_topics(cluster, [request, results])
