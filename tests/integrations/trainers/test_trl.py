"""One real TRL ``GRPOTrainer`` step on a tiny randomly initialised GPT-2 built here, its rewards computed by kiln:
``LeanProofAccepted`` sends every completion of the step to the Lean stage (fake REPL) as one job each. And TRL's own
advantage computation on a group with a completion kiln could not judge: kiln's ``None`` leaves it out of its
group's mean and std, its advantage 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from kiln.integrations.trainers.trl import LeanProofAccepted, Verified
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from tests.integrations.trainers.policy import char_tokenizer, tiny_gpt2
from tests.integrations.trainers.test_no_reward import GROUP, LABEL, REAL
from tests.streams.harness import read_all
from tests.workers.lean.conftest import lean_worker

STATEMENT = "theorem t : p \u2192 p := by"


def test_a_grpo_step_with_kiln_rewards(stage_topics: Callable[..., KilnSettings], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    settings = stage_topics(("lean.requests", 2))
    with lean_worker(settings, 2, free_port()) as worker:
        worker.wait_assigned()
        reward = LeanProofAccepted(settings=settings)
        try:
            # The reward itself, on known proofs: accepted, sorry, wrong.
            assert reward(["intro h; exact h", "sorry", "exact h"], statement=[STATEMENT] * 3) == [1.0, 0.0, 0.0]
            tokenizer = char_tokenizer()
            model = tiny_gpt2(tokenizer)
            data = Dataset.from_dict({"prompt": ["prove p -> p: "] * 8, "statement": [STATEMENT] * 8})
            config = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                                max_completion_length=8, max_steps=1, learning_rate=1e-2, report_to="none",
                                use_cpu=True, logging_steps=1, save_strategy="no", seed=0)
            trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=data,
                                  processing_class=tokenizer)
            trainer.train()
        finally:
            reward.close()
    jobs = read_all(settings, settings.topic("lean.requests"))
    # The two above that are proofs at all ("sorry" is refused before it runs); the step's completions reach Lean
    # only where they are proofs at all (an empty or refused one scores 0 without a job), so the log says it scored.
    assert len(jobs) >= 2, len(jobs)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert any("kiln_lean_proof_accepted" in k for k in logged), logged
    assert trainer.state.global_step == 1


@pytest.mark.docker
def test_an_unjudged_completion_is_left_out_of_its_group(stack: KilnSettings, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of four — right, wrong, right, one the checker cannot judge — scored by ``Verified`` through the
    verify stage inside TRL's own ``_generate_and_score_completions`` (the completions fixed by a ``rollout_func``):
    the unjudged one is ``None``, its advantage 0, and the other three's advantages are their own group's."""
    torch.set_num_threads(1)
    monkeypatch.setenv("KILN_VERIFY_RETRY_ATTEMPTS", "2")
    monkeypatch.setenv("KILN_VERIFY_RETRY_BACKOFF_S", "0.05")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = char_tokenizer()
    reward = Verified(settings=stack)

    def rollout(prompts: list[Any], trainer: GRPOTrainer) -> dict[str, Any]:
        del trainer
        ids = [tokenizer.encode(text) for text in GROUP[:len(prompts)]]
        return {"prompt_ids": [tokenizer.encode(p) for p in prompts], "completion_ids": ids,
                "logprobs": [[-1.0] * len(i) for i in ids]}

    try:
        assert reward(GROUP, kiln_task=[LABEL] * 4) == [1.0, 0.0, 1.0, None]
        data = Dataset.from_dict({"prompt": ["3+4="] * 4, "kiln_task": [LABEL] * 4})
        config = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                            seed=0)
        trainer = GRPOTrainer(model=tiny_gpt2(tokenizer), reward_funcs=[reward], args=config, train_dataset=data,
                              processing_class=tokenizer, rollout_func=rollout)
        trainer.model.train()
        scored = trainer._generate_and_score_completions([{"prompt": "3+4=", "kiln_task": LABEL}] * 4)
    finally:
        reward.close()
    advantages = scored["advantages"]
    assert advantages[3] == 0  # trl/trainer/grpo_trainer.py:2810: an unscorable completion moves nothing
    expected = (REAL - REAL.mean()) / (REAL.std() + 1e-4)  # the group's mean and std over its real verdicts only
    assert torch.allclose(advantages[:3].float(), expected, atol=1e-4), advantages
