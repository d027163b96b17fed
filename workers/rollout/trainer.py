"""The trainer contract (PipelineRL's): forward log-probs, backward on the RL objective, optimizer step, and the
named weights to broadcast — for any torch causal LM whose forward maps token ids [B, L] to logits [B, L, V]
(kiln's ``TinyLM``; a Hugging Face causal LM with ``logits_of=hf_logits``).

Packing (``pack_to`` > 0, for models whose forward takes ``segments``, like kiln's ``TinyLM``): sequences share rows
of up to ``pack_to`` positions, first fit by length, each attending only within itself — the same loss and gradient
as one padded row per sequence, with fewer rows and less padding.

Data-parallel: with ``world`` > 1 (``torch.distributed`` initialised, e.g. gloo), the model is wrapped in
``DistributedDataParallel`` and every rank, given the same groups, trains on its share (every ``world``-th group);
each rank's loss is scaled so that DDP's gradient average equals the single-process gradient over all sequences.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from kiln.workers.rollout.loss import LossReport, leave_one_out, policy_loss


@dataclass
class Sample:
    """One completion of a prompt as the sampler produced it."""

    completion: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    tool_mask: list[int] = field(default_factory=list)
    """1 where the completion holds a tool's output (multi-turn samples): not the policy's, not trained on."""


@dataclass
class Group:
    """The samples of one prompt: the unit of the leave-one-out baseline."""

    prompt: list[int]
    samples: list[Sample]


@dataclass
class StepReport:
    version: int
    loss: LossReport
    reward_mean: float
    sequences: int
    tokens: int
    seconds: float


class PolicyTrainer:
    def __init__(self, model: nn.Module, lr: float = 1e-3, temperature: float = 1.0, max_ratio: float = 2.0,
                 entropy_coef: float = 0.01, pad_id: int = 0,
                 logits_of: Callable[[nn.Module, Tensor], Tensor] | None = None, rank: int = 0,
                 world: int = 1, pack_to: int = 0) -> None:
        self.model = model
        self.pack_to = pack_to
        self.rank, self.world = rank, world
        self._forward: nn.Module = DistributedDataParallel(model) if world > 1 else model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.temperature, self.max_ratio, self.entropy_coef = temperature, max_ratio, entropy_coef
        self.pad_id = pad_id
        self._logits_of = logits_of or (lambda m, tokens: m(tokens))
        self.version = 0

    def batch(self, groups: list[Group]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(inputs, targets, mask, old log-probs, advantages): every sample as prompt + completion, shifted by one,
        right-padded; the mask covers the completion's positions the policy produced (not tools' output)."""
        rows = [(g.prompt, s) for g in groups for s in g.samples]
        width = max(len(p) + len(s.completion) for p, s in rows) - 1
        inputs = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        targets = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        old = torch.zeros(len(rows), width)
        for i, (prompt, sample) in enumerate(rows):
            seq = prompt + sample.completion
            n = len(seq) - 1
            inputs[i, :n] = torch.tensor(seq[:-1])
            targets[i, :n] = torch.tensor(seq[1:])
            start = len(prompt) - 1
            mask[i, start:n] = 1.0
            if sample.tool_mask:
                mask[i, start:n] -= torch.tensor(sample.tool_mask, dtype=mask.dtype)
            old[i, start:n] = torch.tensor(sample.logprobs)
        advantages = torch.cat([leave_one_out(torch.tensor([s.reward for s in g.samples])) for g in groups])
        return inputs, targets, mask, old, advantages

    def packed_batch(self, groups: list[Group]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``batch`` with several sequences per row (first fit by length into rows of ``pack_to``; a longer one gets
        a row of its own), plus the rows' segment ids; advantages are per position."""
        advantages = [leave_one_out(torch.tensor([s.reward for s in g.samples])) for g in groups]
        sequences = [(g.prompt, s, float(a)) for g, adv in zip(groups, advantages, strict=True)
                     for s, a in zip(g.samples, adv, strict=True)]
        sequences.sort(key=lambda item: -(len(item[0]) + len(item[1].completion)))
        rows: list[list[tuple[list[int], Sample, float]]] = []
        fill: list[int] = []
        for item in sequences:
            length = len(item[0]) + len(item[1].completion) - 1
            free = next((r for r, used in enumerate(fill) if used + length <= self.pack_to), None)
            if free is None:
                rows.append([])
                fill.append(0)
                free = len(rows) - 1
            rows[free].append(item)
            fill[free] += length
        width = max(fill)
        shape = (len(rows), width)
        inputs = torch.full(shape, self.pad_id, dtype=torch.long)
        targets = torch.full(shape, self.pad_id, dtype=torch.long)
        segments = torch.full(shape, -1, dtype=torch.long)
        mask, old, per_position = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        for r, row in enumerate(rows):
            at = 0
            for segment, (prompt, sample, advantage) in enumerate(row):
                seq = prompt + sample.completion
                n = len(seq) - 1
                inputs[r, at:at + n] = torch.tensor(seq[:-1])
                targets[r, at:at + n] = torch.tensor(seq[1:])
                segments[r, at:at + n] = segment
                start = at + len(prompt) - 1
                mask[r, start:at + n] = 1.0
                if sample.tool_mask:
                    mask[r, start:at + n] -= torch.tensor(sample.tool_mask, dtype=mask.dtype)
                old[r, start:at + n] = torch.tensor(sample.logprobs)
                per_position[r, at:at + n] = advantage
                at += n
        return inputs, targets, mask, old, per_position, segments

    def step(self, groups: list[Group]) -> StepReport:
        started = time.perf_counter()
        if len(groups) < self.world:
            raise ValueError(f"{len(groups)} groups cannot be shared by {self.world} ranks")
        self.model.train()
        mine = groups[self.rank::self.world]
        if self.pack_to:
            inputs, targets, mask, old, advantages, segments = self.packed_batch(mine)
            logits = self._forward(inputs, segments)
        else:
            inputs, targets, mask, old, advantages = self.batch(mine)
            logits = self._logits_of(self._forward, inputs)
        local = sum(len(g.samples) for g in mine)
        loss, report = policy_loss(logits, targets, mask, old, advantages, self.temperature, self.max_ratio,
                                   self.entropy_coef, sequences=local)
        everyone = sum(len(g.samples) for g in groups)
        loss = loss * (local * self.world / everyone)  # DDP averages over ranks
        self.optimizer.zero_grad()
        torch.autograd.backward(loss)
        self.optimizer.step()
        self.model.eval()
        self.version += 1
        rewards = [s.reward for g in groups for s in g.samples]
        return StepReport(version=self.version, loss=report, reward_mean=sum(rewards) / len(rewards),
                          sequences=len(rewards), tokens=int(mask.sum()), seconds=time.perf_counter() - started)

    def logprobs(self, tokens: Tensor) -> Tensor:
        """Per-position log-probs of ``tokens`` [B, L] (position t scores token t+1), as the sampler computes them."""
        with torch.no_grad():
            logits = self._logits_of(self.model, tokens[:, :-1]).float()
            scaled = torch.log_softmax(logits / (self.temperature if self.temperature > 0 else 1.0), dim=-1)
            return scaled.gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """What to broadcast after a step, in a fixed order."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()


def hf_logits(model: nn.Module, tokens: Tensor) -> Tensor:
    """``logits_of`` for a Hugging Face causal LM (its forward returns an output object)."""
    logits: Tensor = model(input_ids=tokens).logits
    return logits
