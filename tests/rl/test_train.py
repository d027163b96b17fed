"""The trainer on Kafka: steps on groups from ``rollouts``, a checkpoint before every commit and broadcast, the
server updated to each version; a restarted trainer resumes from the checkpoint its commit names and trains only
the rollouts after it. The actor never runs more than ``max_ahead`` groups beyond what the trainer has trained."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from kiln.rl.actor import Actor, ActorSettings
from kiln.rl.tasks import Addition
from kiln.rl.train import RolloutTrainer, TrainSettings, latest_update
from kiln.schemas.rl import RolloutRequest, Sampling
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.model import ModelConfig, weights_digest
from kiln.workers.inference.process import ServerProcess
from tests.stages import worker_env
from tests.streams.harness import read_all


def _committed(settings: KilnSettings, group: str, partitions: int) -> list[TopicPartition]:
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": group})
    try:
        return consumer.committed([TopicPartition(settings.topic("rollouts"), p) for p in range(partitions)],
                                  timeout=10)
    finally:
        consumer.close()


async def test_steps_checkpoint_commit_broadcast_and_resume(stage_topics: Callable[..., KilnSettings],
                                                            tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 2))
    settings = settings.model_copy(update={"blob_store": f"file://{tmp_path / 'blobs'}"})
    config = ModelConfig(max_len=64)
    server = ServerProcess(config, tmp_path / "serve.log")
    server.start()
    train = TrainSettings(group_id=f"trainer-{unique}", groups_per_step=4, endpoints=[server.url],
                          admin_token=server.token, max_len=64)
    tasks = Addition(1)

    async def rollouts(n: int) -> None:
        async with KilnClient(settings, f"actor-{unique}") as client:
            futures = [await client.submit("rollout", RolloutRequest(task=t, sampling=Sampling(n=4, max_tokens=3)))
                       for t in tasks.sample(n)]
            await asyncio.gather(*futures)

    env = worker_env(settings, KILN_ROLLOUT_ENDPOINTS=json.dumps([server.url]))
    try:
        with WorkerProcess("rollout", settings, "rollout.requests", slots=4, env=env) as worker:
            worker.wait_assigned()
            await rollouts(8)
            first = RolloutTrainer(settings, train)
            events = await asyncio.to_thread(first.run, 2)
            assert [e.version for e in events] == [1, 2] and all(e.groups == 4 for e in events)
            assert all(e.servers_updated == 1 and e.servers_failed == {} for e in events)
            assert server.weights() == {"version": 2, "sha256": weights_digest(first.trainer.model)}
            committed = _committed(settings, train.group_id, 2)
            assert sum(p.offset for p in committed) == 8  # both steps' groups, nothing beyond
            assert {p.metadata for p in committed} == {events[-1].checkpoint}

            # A new trainer process (same group) resumes at version 2 with the same weights, on new rollouts only.
            await rollouts(4)
            second = RolloutTrainer(settings, train)
            events = await asyncio.to_thread(second.run, 1)
            assert [e.version for e in events] == [3] and events[0].groups == 4
            assert server.weights()["version"] == 3
            assert latest_update(settings) == events[0].model_dump(mode="json")

            # Enough tokens start a step before enough groups have arrived (rows packed).
            await rollouts(2)
            eager = RolloutTrainer(settings, train.model_copy(update={"groups_per_step": 100, "tokens_per_step": 1,
                                                                      "pack_to": 64}))
            events = await asyncio.to_thread(eager.run, 2)
            assert [(e.version, e.groups) for e in events] == [(4, 1), (5, 1)]
            worker.stop()
    finally:
        server.stop()


async def test_the_actor_stays_within_max_ahead_of_the_trainer(stage_topics: Callable[..., KilnSettings],
                                                               tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 2))
    settings = settings.model_copy(update={"blob_store": f"file://{tmp_path / 'blobs'}"})
    server = ServerProcess(ModelConfig(max_len=64), tmp_path / "serve.log")
    server.start()
    env = worker_env(settings, KILN_ROLLOUT_ENDPOINTS=json.dumps([server.url]))
    try:
        with WorkerProcess("rollout", settings, "rollout.requests", slots=4, env=env) as worker:
            worker.wait_assigned()
            actor = Actor(settings, Addition(1), ActorSettings(client_id=f"actor-{unique}", max_ahead=4, n=4,
                                                               ))
            running = asyncio.create_task(actor.run(groups=12))
            await asyncio.sleep(3)
            assert not running.done()  # held back: nothing trained yet
            assert len(read_all(settings, settings.topic("rollouts"), expect=4)) == 4
            trainer = RolloutTrainer(settings, TrainSettings(group_id=f"trainer-{unique}", groups_per_step=4,
                                                             endpoints=[server.url], admin_token=server.token,
                                                             max_len=64))
            events = await asyncio.to_thread(trainer.run, 2)
            report = await asyncio.wait_for(running, 60)
            worker.stop()
    finally:
        server.stop()
    assert [e.groups_total for e in events] == [4, 8]
    assert report.submitted == report.answered == 12 and report.failed == 0 and report.held_back_s > 0
    assert report.latest_version == 2
    assert len(read_all(settings, settings.topic("rollouts"), expect=12)) == 12
