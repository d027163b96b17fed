"""The rollout stage end to end with real processes: a worker samples each prompt group from a running inference
server, rewards every sample with its verifier, answers the requester and publishes the same group on
``rollouts``; a server that refuses the prompt is an answer, not a dead letter."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.schemas.rl import RolloutGroup, RolloutRequest, Sampling
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.model import TOKENIZER, ModelConfig
from kiln.workers.inference.process import ServerProcess
from kiln.workers.rollout.tasks import Addition, exact_match
from tests.streams.harness import read_all
from tests.workers.conftest import worker_env


async def test_groups_are_sampled_verified_and_published(stage_topics: Callable[..., KilnSettings],
                                                         tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1))
    server = ServerProcess(ModelConfig(max_len=64), tmp_path / "serve.log")
    server.start()
    tasks = Addition(1).sample(6)
    env = worker_env(settings, KILN_ROLLOUT_ENDPOINTS=json.dumps([server.url]))
    try:
        with WorkerProcess("rollout", settings, "rollout.requests", slots=4, env=env) as worker:
            worker.wait_assigned()
            async with KilnClient(settings, f"actor-{unique}") as client:
                groups: list[RolloutGroup] = [
                    await client.call("rollout", RolloutRequest(task=t, sampling=Sampling(n=4, max_tokens=3),
                                                                actor_version=2)) for t in tasks]
                too_long = RolloutRequest(task=Addition().task(1, 1).model_copy(update={"prompt": "9" * 100}))
                with pytest.raises(RequestFailed, match="RoutineJobError"):
                    await client.call("rollout", too_long)
            worker.stop()
    finally:
        server.stop()
    for task, group in zip(tasks, groups, strict=True):
        assert group.task_id == task.task_id and len(group.samples) == 4 and group.actor_version == 2
        assert group.version_start == group.version_end == 0 and group.endpoint == server.url
        for sample in group.samples:
            assert 1 <= len(sample.token_ids) <= 3 and len(sample.logprobs) == len(sample.token_ids)
            assert sample.versions == [0] * len(sample.token_ids)
            assert TOKENIZER.decode(sample.token_ids).startswith(sample.text)
            assert sample.reward == exact_match(task, sample.text)
    published = [RolloutGroup.model_validate_json(m.value())
                 for m in read_all(settings, settings.topic("rollouts"), expect=len(tasks))]
    assert sorted(g.model_dump_json() for g in published) == sorted(g.model_dump_json() for g in groups)
    assert read_all(settings, settings.topic("rollout.requests.dlq")) == []
