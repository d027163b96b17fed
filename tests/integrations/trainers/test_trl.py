"""One real TRL ``GRPOTrainer`` step on a tiny randomly initialised GPT-2 built here, its rewards computed by kiln:
``LeanProofAccepted`` sends every completion of the step to the Lean stage (fake REPL) as one job each."""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from kiln.integrations.trainers.trl import LeanProofAccepted
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from tests.streams.harness import read_all
from tests.workers.lean.conftest import lean_worker

STATEMENT = "theorem t : p \u2192 p := by"


def char_tokenizer() -> PreTrainedTokenizerFast:
    symbols = ["<pad>", "<eos>", "<unk>", *string.printable[:95], "\u2192", "\u2227"]
    core = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


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
            model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1,
                                               n_head=2, bos_token_id=1, eos_token_id=1, pad_token_id=0))
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
