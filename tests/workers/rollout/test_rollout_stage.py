"""The rollout stage end to end with real processes: a worker samples each prompt group from a running inference
server, rewards every sample with its verifier, answers the requester and publishes the same group on
``rollouts``; a server that refuses the prompt is an answer, not a dead letter. A group with a sample kiln could
not judge is answered as an error and never published with a 0 for it; a sample that failed by itself is a real 0.
With a Hugging Face policy the group's prompt and completion ids are the ones sampled: the model scores them exactly
as the sampler did."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.rl.tasks import Addition, exact_match
from kiln.schemas.rl import RolloutGroup, RolloutRequest, RolloutTask, Sampling
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.hf import build_tiny_model
from kiln.workers.inference.model import TOKENIZER, ModelConfig
from kiln.workers.inference.process import ServerProcess
from kiln.workers.inference.tokenizer import load_tokenizer, tokenize_prompt
from tests.stages import worker_env
from tests.streams.harness import read_all
from tests.workers.rollout.actors import rollout_with_exec
from tests.workers.verify.conftest import check


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
        assert group.prompt_ids == TOKENIZER.encode(task.prompt)
    published = [RolloutGroup.model_validate_json(m.value())
                 for m in read_all(settings, settings.topic("rollouts"), expect=len(tasks))]
    assert sorted(g.model_dump_json() for g in published) == sorted(g.model_dump_json() for g in groups)
    assert read_all(settings, settings.topic("rollout.requests.dlq")) == []


# A checker that judges no completion itself: it says each is kiln's failure (a checker that broke), or that it
# stopped each one's program past its time (the completion's failure).
def _saying(verdict: dict[str, object]) -> RolloutTask:
    checker = ("import json\nfor line in open('groups.jsonl'):\n    group = json.loads(line)\n"
               f"    print(json.dumps({{'verdicts': [{verdict!r}] * len(group['completions'])}}))\n")
    return RolloutTask(task_id=f"saying-{verdict['failure']}", prompt="1+1=", answer="2", verifier="exec",
                       check=check(files={"check.py": checker}))


async def test_a_group_kiln_could_not_judge_is_an_error_never_zeros(stage_topics: Callable[..., KilnSettings],
                                                                   tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1), ("exec.requests", 2))
    sampling = Sampling(n=3, max_tokens=3)
    async with rollout_with_exec(settings, tmp_path, unique) as client:
        with pytest.raises(RequestFailed, match=r"VerifyError.*3 of 3 completions got no verdict"):
            await client.call("rollout", RolloutRequest(task=_saying({"failure": "checker_error"}), sampling=sampling))
        stopped: RolloutGroup = await client.call("rollout", RolloutRequest(task=_saying({"failure": "timeout"}),
                                                                            sampling=sampling))
    assert [(s.reward, s.verifier["policy_failure"]) for s in stopped.samples] == [(0.0, "timeout")] * 3
    published = [RolloutGroup.model_validate_json(m.value())
                 for m in read_all(settings, settings.topic("rollouts"), expect=1)]
    assert [g.task_id for g in published] == ["saying-timeout"]  # the unjudged group never reaches the trainer


async def test_a_hugging_face_policys_groups_carry_the_tokens_it_sampled(
        stage_topics: Callable[..., KilnSettings], tmp_path: Path, unique: str) -> None:
    """kiln's server serving a Llama built here, the worker tokenising with its tokenizer: the prompt goes through
    the chat template once, and the model, fed the group's ``prompt_ids + token_ids`` in one pass (the trainer's
    view), gives every sampled token the log-prob the sampler reported — other ids (a re-tokenised text, a
    shifted prompt) would not."""
    torch.set_num_threads(1)
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1))
    model_dir = build_tiny_model(tmp_path / "tiny", [f"add {a}+{b}={a + b}\n" for a in range(10) for b in range(10)])
    server = ServerProcess(ModelConfig(max_len=128), tmp_path / "serve.log", env={"KILN_RL_MODEL": str(model_dir)})
    server.start()
    tasks = Addition(1).sample(2)
    env = worker_env(settings, KILN_ROLLOUT_ENDPOINTS=json.dumps([server.url]), KILN_ROLLOUT_MODEL=str(model_dir))
    try:
        with WorkerProcess("rollout", settings, "rollout.requests", slots=2, env=env) as worker:
            worker.wait_assigned()
            async with KilnClient(settings, f"actor-{unique}") as client:
                groups: list[RolloutGroup] = [await client.call("rollout", RolloutRequest(
                    task=t, sampling=Sampling(n=4, max_tokens=8))) for t in tasks]
            worker.stop()
    finally:
        server.stop()
    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # in eval mode, as from_pretrained leaves it
    for task, group in zip(tasks, groups, strict=True):
        assert group.prompt_ids == tokenize_prompt(tokenizer, task.prompt)
        for sample in group.samples:
            assert 1 <= len(sample.token_ids) <= 8 and sample.versions == [0] * len(sample.token_ids)
            assert tokenizer.decode(sample.token_ids) == sample.text
            sequence = torch.tensor([group.prompt_ids + sample.token_ids])
            with torch.no_grad():
                logits = model(sequence).logits[0, len(group.prompt_ids) - 1:-1]
            scored = torch.log_softmax(logits.float(), -1).gather(1, sequence[0, len(group.prompt_ids):, None])
            assert torch.allclose(scored[:, 0], torch.tensor(sample.logprobs), atol=1e-4), (scored, sample.logprobs)
    assert read_all(settings, settings.topic("rollout.requests.dlq")) == []
