"""The learning loop in one process: the baseline the stages are measured against (``bench/rl.py``'s
``rl_stage_overhead_ratio``). The same engine (continuous batching, kiln's sampler), the same trainer
(``PolicyTrainer``), task source, in-process ``exact_match``, policy shape, seed and sampling as a ``LearningRun``
of the same ``RunConfig`` — without Kafka, HTTP or processes. Synchronous, as one process runs it: a step's groups
are sampled together, rewarded, trained on, and the new weights swapped into the engine between two decode steps
(what the server's weight update does).
"""

from __future__ import annotations

import hashlib
import time

import torch
from pydantic import BaseModel, Field

from kiln.rl.actor import group_seed
from kiln.rl.local import RunConfig
from kiln.rl.tasks import Addition, exact_match
from kiln.rl.trainer import Group, PolicyTrainer, Sample
from kiln.workers.inference.engine import Engine, SamplingParams
from kiln.workers.inference.model import ModelConfig, TinyLM
from kiln.workers.inference.tokenizer import load_tokenizer, tokenize_prompt


class StepTiming(BaseModel):
    """Where one step's time went, in seconds."""

    ended: float = Field(description="seconds since the loop started")
    cpu_s: float = Field(description="CPU seconds of this process (every thread) since the loop started")
    sample_s: float
    verify_s: float
    train_s: float
    load_s: float = Field(description="the new weights into the engine")
    reward_mean: float
    sampled: str = Field(description="a digest of the step's sampled token ids: equal seeds sample equal tokens")


class InProcessRecord(BaseModel):
    config: RunConfig
    steps: list[StepTiming]

    @property
    def step_ends(self) -> list[float]:
        return [s.ended for s in self.steps]


def run_in_process(config: RunConfig, max_batch: int = 64) -> InProcessRecord:
    """``config.steps`` steps of ``config.groups_per_step`` groups (``max_batch``: the server's default). The
    character model only (``config.model`` "char"): kiln's engine samples it in process."""
    if config.model != "char":
        raise ValueError(f"the in-process baseline runs the character model, not {config.model!r}")
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(config.model)
    shape = ModelConfig(d_model=config.d_model, n_layers=config.n_layers, max_len=32, seed=config.seed)
    trainer = PolicyTrainer(TinyLM(shape), lr=config.lr, entropy_coef=config.entropy_coef)
    engine = Engine(TinyLM(shape), max_batch=max_batch)
    tasks = Addition(1, seed=config.seed)
    steps: list[StepTiming] = []
    started, cpu = time.perf_counter(), time.process_time()
    try:
        for step in range(config.steps):
            t0 = time.perf_counter()
            batch = tasks.sample(config.groups_per_step)
            prompts = [tokenize_prompt(tokenizer, task.prompt) for task in batch]
            futures = [[engine.submit(prompt, SamplingParams(
                max_tokens=config.max_tokens, temperature=1.0,
                seed=group_seed(config.seed, step * config.groups_per_step + g) + i)) for i in range(config.n)]
                for g, prompt in enumerate(prompts)]
            generations = [[f.result() for f in group] for group in futures]
            t1 = time.perf_counter()
            groups = [Group(prompt=prompt, samples=[
                Sample(g.tokens, g.logprobs, g.versions, exact_match(task, g.text)) for g in group])
                for task, prompt, group in zip(batch, prompts, generations, strict=True)]
            t2 = time.perf_counter()
            report = trainer.step(groups)
            t3 = time.perf_counter()
            with engine.paused():
                engine.load({name: w.clone() for name, w in trainer.named_weights()}, report.version)
            t4 = time.perf_counter()
            steps.append(StepTiming(ended=t4 - started, cpu_s=time.process_time() - cpu, sample_s=t1 - t0,
                                    verify_s=t2 - t1, train_s=t3 - t2, load_s=t4 - t3, reward_mean=report.reward_mean,
                                    sampled=hashlib.sha256(repr([g.tokens for group in generations
                                                                 for g in group]).encode()).hexdigest()[:16]))
    finally:
        engine.stop()
    return InProcessRecord(config=config, steps=steps)
