"""Moving traffic between two real brokers with a configuration change only: a client restarted with cluster A
marked draining sends new requests to B, and A's in-flight results from the previous life still arrive, each once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kiln.schemas.builtin import SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams import admin
from kiln.streams.clusters import ClusterClient
from kiln.streams.codec import decode_result
from kiln.streams.errors import ConfigError
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import Cluster, KilnSettings
from kiln.streams.stage import TopicSpec
from tests.streams.harness import read_all

KAFKA = Path(__file__).resolve().parents[2] / "infra" / "kafka" / "kafka.sh"
SECOND_PORT = 19492


@pytest.fixture(scope="module")
def second_broker(kafka: KilnSettings) -> Iterator[str]:
    env = {**os.environ, "KILN_KAFKA_PORT": str(SECOND_PORT)}
    subprocess.run(["bash", str(KAFKA), "start"], env=env, check=True, stdout=subprocess.DEVNULL)
    yield f"127.0.0.1:{SECOND_PORT}"
    subprocess.run(["bash", str(KAFKA), "stop"], env=env, check=False, stdout=subprocess.DEVNULL)


async def _first_life(settings: KilnSettings, clusters: list[Cluster], client_id: str) -> list[str]:
    """Submits and exits with everything still in flight (a restart)."""
    async with ClusterClient(settings, client_id, clusters=clusters) as client:
        assert client.active == "a"
        ids = []
        for i in range(12):
            ids.append(f"old{i}-{client_id}")
            await client.submit("sleep", SleepRequest(seconds=1.5, tag=f"old{i}"), request_id=ids[-1])
        return ids


async def _second_life(settings: KilnSettings, clusters: list[Cluster], client_id: str,
                       owed: int) -> tuple[list[ResultEnvelope], list[ResultEnvelope]]:
    async with ClusterClient(settings, client_id, clusters=clusters) as client:
        assert client.active == "b"
        futures = [await client.submit("sleep", SleepRequest(seconds=0.2, tag=f"new{i}")) for i in range(12)]
        late: list[ResultEnvelope] = []

        async def collect() -> None:
            async for envelope in client.unclaimed():
                late.append(envelope)
                if len(late) == owed:
                    return

        fresh = await asyncio.gather(*futures)
        await asyncio.wait_for(collect(), 120)
        # A marker result behind everything on A's results partition for this client: a result delivered twice
        # would come out of unclaimed() before it (one partition keeps its order), so the count is exact.
        marker = ResultEnvelope(request_id=f"marker-{client_id}", kind="sleep", client_id=client_id, status="ok")
        producer = Producer(settings.kafka())
        producer.produce(settings.topic("kiln.results"), marker.model_dump_json().encode(), key=client_id,
                         partition=zlib.crc32(client_id.encode()) % 2)  # the client's results partition
        assert producer.flush(30) == 0

        async def until_marker() -> None:
            async for envelope in client.unclaimed():
                if envelope.request_id == marker.request_id:
                    return
                late.append(envelope)

        await asyncio.wait_for(until_marker(), 60)
        client.drain("b")
        await asyncio.wait_for(client.drained("b"), 5)
        with pytest.raises(ConfigError, match="every cluster is draining"):
            await client.submit("sleep", SleepRequest())
        return list(fresh), late


def test_a_config_change_moves_traffic_and_delivers_everything_once(kafka: KilnSettings, second_broker: str,
                                                                     unique: str, tmp_path: Path) -> None:
    settings = kafka.model_copy(update={"topic_prefix": f"t{unique}.", "cache": tmp_path / "cache"})
    b_settings = settings.model_copy(update={"bootstrap_servers": second_broker})
    specs = [TopicSpec("kiln.results", 2), TopicSpec("sleep.requests", 2), TopicSpec("sleep.requests.dlq", 1)]
    for s in (settings, b_settings):
        admin.wait_for_broker(s)
        admin.create_topics(s, specs)
    env = {"KILN_TOPIC_PREFIX": settings.topic_prefix}
    workers = [WorkerProcess("sleep", s, "sleep.requests", slots=2, env=env) for s in (settings, b_settings)]
    try:
        for w in workers:
            w.wait_assigned()
        a, b = Cluster(name="a", bootstrap_servers=kafka.bootstrap_servers), Cluster(name="b",
                                                                                      bootstrap_servers=second_broker)
        client_id = f"mover-{unique}"
        old = asyncio.run(_first_life(settings, [a, b], client_id))
        # The configuration change: A drains. Nothing else changes.
        fresh, late = asyncio.run(_second_life(settings, [a.model_copy(update={"draining": True}), b], client_id,
                                               owed=len(old)))
        assert all(r.status == "ok" for r in fresh + late)
        assert sorted(r.request_id for r in late) == sorted(old)  # every in-flight result of A, once
        assert [r.result["tag"] for r in fresh if r.result] == [f"new{i}" for i in range(12)]  # each its own job
        # On the topics too, one result per request: A's for the first life only, B's for the second only.
        on_a = [decode_result(m.value()).request_id for m in read_all(settings, settings.topic("kiln.results"))]
        on_b = [decode_result(m.value()).request_id for m in read_all(b_settings, b_settings.topic("kiln.results"))]
        assert sorted(on_a) == sorted([*old, f"marker-{client_id}"])
        assert sorted(on_b) == sorted(r.request_id for r in fresh) and len(set(on_b)) == 12
        assert len(read_all(settings, settings.topic("sleep.requests"))) == 12  # A got only the first life's
        assert len(read_all(b_settings, b_settings.topic("sleep.requests"))) == 12
    finally:
        WorkerProcess.stop_all(workers)
