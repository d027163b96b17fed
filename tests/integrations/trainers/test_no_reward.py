"""A completion kiln could not judge reaches each trainer as that trainer's own "no reward", through the trainer's
installed code, and is left out of its group: never a 0 that would shift the group's baseline. One group of four —
right ("7"), wrong ("8"), right, and one the checker cannot judge ("?": a ``checker_error`` verdict, retried, still
kiln's failure) — goes through:

- verl 0.9.1: ``KilnRewardManager.run_single`` per sample, verl's ``assemble_rm_scores`` and
  ``compute_grpo_outcome_advantage``: the unjudged sample's advantage is 0, the others' are the real three's.
- OpenRLHF 0.11.2: its own ``SingleTurnAgentExecutor`` client, one request per sample, at the gateway: the unjudged
  sample gets the real three's mean, flagged ``kiln_failed``. OpenRLHF's advantage code cannot be imported here
  (``openrlhf.trainer.ppo_utils.experience_maker`` imports ``flash_attn`` through ``openrlhf.models``, a CUDA build;
  ``samples_generator`` imports ``vllm``): blocked, the imputed value is checked against the real ones' mean.
- AReaL 1.0.4: its ``GroupedRolloutWorkflow`` around ``KilnRLVRWorkflow``: the group with an unjudged episode fails
  (AReaL's executor rejects it), a fully judged group comes back whole with its rewards.
- ``verifiers`` 0.4.0: ``KilnTask.score`` raises ``vf.SandboxError`` through verifiers' own scoring boundary (its stop
  condition ``sandbox_error``), and verifiers' error-corrected mean leaves that trace out.

TRL's (a real ``GRPOTrainer``'s advantages) is in ``test_trl.py``; kiln's own rollout stage answering such a group as
an error is in ``tests/workers/rollout/test_rollout_stage.py``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kiln.integrations.trainers as trainers
from kiln.integrations.trainers.errors import NoReward
from kiln.schemas.rl import RolloutTask
from kiln.streams.settings import KilnSettings
from tests.integrations.gateway.conftest import gateway_process
from tests.integrations.trainers.conftest import trainer
from tests.integrations.trainers.policy import char_tokenizer
from tests.workers.verify.conftest import IMAGE

pytestmark = pytest.mark.docker

# One verdict per completion: the group's answer scores 1, "?" is a completion this checker cannot judge (kiln's
# failure, no reward), anything else 0.
UNSURE_CHECKER = """\
import json
for line in open("groups.jsonl"):
    group = json.loads(line)
    print(json.dumps({"verdicts": [{"failure": "checker_error", "why": "cannot judge"} if c.strip() == "?" else
                                   {"reward": 1.0 if c.strip() == group["answer"] else 0.0}
                                   for c in group["completions"]]}))
"""
TASK = RolloutTask(task_id="add-unsure", prompt="3+4=", answer="7", verifier="exec",
                   check={"image": IMAGE, "command": "python3 -I check.py", "files": {"check.py": UNSURE_CHECKER},
                          "timeout_s": 30})
LABEL = TASK.model_dump(exclude={"task_id", "prompt"})
GROUP = ["7", "8", "7", "?"]
REAL = torch.tensor([1.0, 0.0, 1.0])


@pytest.fixture
def kiln(stack: KilnSettings, monkeypatch: pytest.MonkeyPatch) -> Iterator[KilnSettings]:
    """The adapters' client on the stack, retrying kiln's failures quickly (the checker's "?" stays unjudged)."""
    monkeypatch.setenv("KILN_VERIFY_RETRY_ATTEMPTS", "2")
    monkeypatch.setenv("KILN_VERIFY_RETRY_BACKOFF_S", "0.05")
    monkeypatch.setenv("KILN_VERIFY_GROUP_WAIT_S", "3")  # a group short of its size imputes after that
    trainers.configure(stack)
    yield stack
    trainers.configure(None)


def grpo(rewards: torch.Tensor) -> torch.Tensor:
    return (rewards - rewards.mean()) / (rewards.std() + 1e-6)


async def test_verl_gives_the_unjudged_sample_its_groups_mean(kiln: KilnSettings) -> None:
    trainer("verl.experimental.reward_loop.reward_manager.base")
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from kiln.integrations.trainers.verl_manager import KilnRewardManager

    tokenizer = char_tokenizer()
    manager = KilnRewardManager(OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 4}}}), tokenizer)
    width = 4
    texts, uids = [*GROUP, "?", "?"], ["g1"] * 4 + ["g2"] * 2  # g2: a group with no real verdict at all

    def tensors(chosen: list[str]) -> dict[str, torch.Tensor]:
        prompt = torch.tensor([tokenizer.encode("3+4=")] * len(chosen))
        responses = torch.tensor([tokenizer.encode(t) + [0] * (width - len(t)) for t in chosen])
        mask = torch.cat([torch.ones_like(prompt), (responses != 0).long()], dim=1)
        return {"prompts": prompt, "responses": responses, "attention_mask": mask}

    def sample(i: int) -> Any:  # one sample, as verl's agent loop scores it
        return DataProto.from_dict(tensors([texts[i]]), non_tensors={
            "uid": np.array([uids[i]], dtype=object), "reward_model": np.array([{"ground_truth": ""}], dtype=object),
            "extra_info": np.array([{"kiln_task": LABEL}], dtype=object)})

    outputs = await asyncio.gather(*(manager.run_single(sample(i)) for i in range(len(texts))))
    scores = [o["reward_score"] for o in outputs]
    assert scores[:3] == [1.0, 0.0, 1.0] and scores[3] == pytest.approx(2 / 3) and scores[4:] == [0.0, 0.0]
    assert [o["reward_extra_info"]["kiln_failure"] for o in outputs] == ["", "", "", "checker_error"] + [
        "checker_error"] * 2
    # verl's own: the scores into rm_scores, then GRPO's advantage over each uid.
    batch = DataProto.from_dict(tensors(texts), non_tensors={"uid": np.array(uids, dtype=object)})
    rm_scores = KilnRewardManager.assemble_rm_scores(batch, scores)
    response_mask = batch.batch["attention_mask"][:, -width:]
    advantages, _ = compute_grpo_outcome_advantage(token_level_rewards=rm_scores, response_mask=response_mask,
                                                   index=np.array(uids, dtype=object))
    per_sample = advantages.sum(-1) / response_mask.sum(-1)
    assert per_sample[3].abs() < 1e-5  # the unjudged sample moves nothing
    assert torch.all(per_sample[4:] == 0)  # a group with no real verdict: every advantage 0
    # The real three keep the signs of their own group's advantage; a 0 in place of the imputed mean would have
    # pushed the policy away from a completion kiln never judged.
    assert torch.equal(torch.sign(per_sample[:3]), torch.sign(grpo(REAL)))
    assert grpo(torch.tensor([1.0, 0.0, 1.0, 0.0]))[3] < 0


async def test_openrlhf_gets_the_groups_mean_from_the_gateway(kiln: KilnSettings, tmp_path: Path) -> None:
    agent = trainer("openrlhf.utils.agent")
    with gateway_process(kiln, tmp_path / "gateway.log", KILN_GATEWAY_OPENRLHF_GROUP_SIZE="4",
                         KILN_VERIFY_RETRY_ATTEMPTS="2", KILN_VERIFY_RETRY_BACKOFF_S="0.05") as url:
        executor = agent.SingleTurnAgentExecutor(remote_rm_url=f"{url}/openrlhf/reward")
        # A prompt's samples, each its own request, all at once (openrlhf/trainer/ray/vllm_engine.py:195).
        answers = await asyncio.gather(*(executor._fetch_rewards_via_http([f"3+4={t}"], ["3+4="],
                                                                          [json.dumps(LABEL)]) for t in GROUP))
    rewards = [a[0]["rewards"][0] for a in answers]
    failed = [a[0]["extra_logs"]["kiln_failed"][0] for a in answers]
    assert failed == [0.0, 0.0, 0.0, 1.0]
    assert rewards[:3] == [1.0, 0.0, 1.0] and rewards[3] == pytest.approx(float(REAL.mean()))
    # Under OpenRLHF's group_norm / dr_grpo (group mean subtracted) the imputed sample's advantage is then 0.
    assert (torch.tensor(rewards) - torch.tensor(rewards).mean())[3].abs() < 1e-6


async def test_areal_rejects_a_group_with_an_unjudged_episode(kiln: KilnSettings) -> None:
    trainer("areal.workflow.rlvr")
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelResponse
    from areal.infra import workflow_context
    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow

    from kiln.integrations.trainers.areal_workflow import KilnRLVRWorkflow

    tokenizer = char_tokenizer()
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False, task_id=0))

    class Engine:  # the inference server: answers each episode's request with the next of its outputs
        def __init__(self, outputs: list[str]) -> None:
            self.outputs = list(outputs)

        async def agenerate(self, request: Any) -> ModelResponse:
            out = tokenizer.encode(self.outputs.pop(0))
            return ModelResponse(input_tokens=list(request.input_ids), output_tokens=out,
                                 output_logprobs=[-1.0] * len(out), output_versions=[0] * len(out))

    workflow = KilnRLVRWorkflow(gconfig=GenerationHyperparameters(max_new_tokens=4), tokenizer=tokenizer,
                                get_input_ids_fn=lambda data, tok, thinking: tok.encode(data),
                                data_extract_prompt_fn=lambda data: data["prompt"])
    group = GroupedRolloutWorkflow(workflow, 3, logging.getLogger("areal"))
    data = {"prompt": "3+4=", "kiln_task": LABEL}
    judged = await group.arun_episode(Engine(["7", "8", "7"]), data)
    assert judged is not None and sorted(judged["rewards"].tolist()) == [0.0, 1.0, 1.0]
    # One episode kiln could not judge: the group's gather fails, and AReaL's executor rejects the whole group
    # (areal/infra/workflow_executor.py:1143) rather than train on a shortened or zero-filled one.
    with pytest.raises(NoReward, match="checker_error"):
        await group.arun_episode(Engine(["7", "?", "8"]), data)


async def test_verifiers_errors_the_trace(kiln: KilnSettings) -> None:
    vf = trainer("verifiers.v1")
    from verifiers.v1.errors import boundary, stop_condition
    from verifiers.v1.utils.format import format_mean

    from kiln.integrations.trainers.prime import KilnTask, KilnTaskData

    traces = []
    for reply in GROUP:
        trace = vf.Trace.model_construct(root_reply=reply, rewards={}, metrics={})
        try:
            async with boundary(vf.TaskError, "scoring"):  # the rollout's scoring boundary (v1/rollout.py:610)
                await KilnTask(KilnTaskData(prompt="3+4=", kiln_task=LABEL)).score(trace)
            trace.ok = True
        except vf.RolloutError as e:
            assert isinstance(e, vf.SandboxError) and stop_condition(e) == "sandbox_error", e
            trace.ok = False
        trace.is_completed = True
        traces.append(trace)
    assert [t.ok for t in traces] == [True, True, True, False]
    assert [t.rewards["kiln"].value for t in traces[:3]] == [1.0, 0.0, 1.0]
    # verifiers' error-corrected mean (v1/utils/format.py:66): the errored trace is left out, not counted as 0.
    assert format_mean(traces, lambda t: t.reward).startswith(f"{float(REAL.mean()):.2f}")
