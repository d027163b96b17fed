"""The trainer contract (PipelineRL's): forward log-probs, backward on the RL objective, optimizer step, and the
named weights to broadcast — for any torch causal LM whose forward maps token ids [B, L] to logits [B, L, V]
(kiln's ``TinyLM``; a Hugging Face causal LM with ``logits_of=hf_logits``).

Placement and precision: the model lives on ``device``; ``precision`` "bf16" or "fp16" runs the forward under
autocast (the weights and the optimizer stay float32, so what is broadcast and checkpointed is float32), "fp16" with a
gradient scaler (its range is too narrow for small gradients). Which the device has is checked up front.

Micro-batches (``micro_batch_tokens`` > 0): a step's sequences are cut, longest first, into micro-batches of at most
that many positions (padded rows: rows x width; packed rows: the rows' positions), each forward and backward on its
own with the gradients accumulating. Every micro-batch's loss is divided by the step's whole sequence count, so the
summed gradient is the one-batch gradient (the leave-one-out advantages are computed per group before the cut).

Packing (``pack_to`` > 0, for models whose forward takes ``segments``, like kiln's ``TinyLM``): sequences share rows
of up to ``pack_to`` positions, first fit by length, each attending only within itself — the same loss and gradient
as one padded row per sequence, with fewer rows and less padding.

Data-parallel: with ``world`` > 1 (``torch.distributed`` initialised, e.g. gloo), the model is wrapped in
``DistributedDataParallel`` and every rank, given the same groups, trains on its share (every ``world``-th group);
each rank's loss is scaled so that DDP's gradient average equals the single-process gradient over all sequences.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from kiln.rl.loss import LossReport, leave_one_out, policy_loss
from kiln.streams.errors import ConfigError

Precision = Literal["fp32", "bf16", "fp16"]
AUTOCAST: dict[Precision, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    micro_batches: int = 1


Sequence = tuple[list[int], Sample, float]
"""(prompt, sample, its advantage): one row of a batch."""


def _length(item: Sequence) -> int:
    """Positions the sequence takes in a row (inputs are shifted by one)."""
    return len(item[0]) + len(item[1].completion) - 1


def check_precision(device: torch.device, precision: Precision) -> None:
    """Refuses a precision the device cannot autocast to (before the first step rather than inside it)."""
    if precision == "fp32":
        return
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"{device} has no bf16; use fp16 or fp32")
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise ConfigError(f"no autocast on {device.type}; use fp32")


class PolicyTrainer:
    def __init__(self, model: nn.Module, lr: float = 1e-3, temperature: float = 1.0, max_ratio: float = 2.0,
                 entropy_coef: float = 0.01, pad_id: int = 0,
                 logits_of: Callable[[nn.Module, Tensor], Tensor] | None = None, rank: int = 0,
                 world: int = 1, pack_to: int = 0, device: str = "cpu", precision: Precision = "fp32",
                 micro_batch_tokens: int = 0) -> None:
        self.device = torch.device(device)
        check_precision(self.device, precision)
        self.precision = precision
        self.model = model.to(self.device)
        self.pack_to = pack_to
        self.micro_batch_tokens = micro_batch_tokens
        self.rank, self.world = rank, world
        self._ddp = DistributedDataParallel(model) if world > 1 else None
        self._forward: nn.Module = self._ddp or model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        self.temperature, self.max_ratio, self.entropy_coef = temperature, max_ratio, entropy_coef
        self.pad_id = pad_id
        self._logits_of = logits_of or (lambda m, tokens: m(tokens))
        self.version = 0

    @staticmethod
    def sequences(groups: list[Group]) -> list[Sequence]:
        """Every sample with its prompt and its leave-one-out advantage (computed within its whole group)."""
        advantages = [leave_one_out(torch.tensor([s.reward for s in g.samples])) for g in groups]
        return [(g.prompt, s, float(a)) for g, adv in zip(groups, advantages, strict=True)
                for s, a in zip(g.samples, adv.tolist(), strict=True)]

    def batch(self, groups: list[Group]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(inputs, targets, mask, old log-probs, advantages): every sample as prompt + completion, shifted by one,
        right-padded; the mask covers the completion's positions the policy produced (not tools' output)."""
        return self._padded(self.sequences(groups))

    def _padded(self, rows: list[Sequence]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        width = max(_length(r) for r in rows)
        inputs = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        targets = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        old = torch.zeros(len(rows), width)
        for i, (prompt, sample, _advantage) in enumerate(rows):
            self._place(inputs[i], targets[i], mask[i], old[i], 0, prompt, sample)
        return inputs, targets, mask, old, torch.tensor([a for _p, _s, a in rows])

    @staticmethod
    def _place(inputs: Tensor, targets: Tensor, mask: Tensor, old: Tensor, at: int, prompt: list[int],
               sample: Sample) -> int:
        """Writes one sequence into a row from position ``at``; returns the positions it took."""
        seq = prompt + sample.completion
        n = len(seq) - 1
        inputs[at:at + n] = torch.tensor(seq[:-1])
        targets[at:at + n] = torch.tensor(seq[1:])
        start = at + len(prompt) - 1
        mask[start:at + n] = 1.0
        if sample.tool_mask:
            mask[start:at + n] -= torch.tensor(sample.tool_mask, dtype=mask.dtype)
        old[start:at + n] = torch.tensor(sample.logprobs)
        return n

    def packed_batch(self, groups: list[Group]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``batch`` with several sequences per row (first fit by length into rows of ``pack_to``; a longer one gets
        a row of its own), plus the rows' segment ids; advantages are per position."""
        return self._packed(self.sequences(groups))

    def _pack(self, sequences: list[Sequence]) -> list[list[Sequence]]:
        rows: list[list[Sequence]] = []
        fill: list[int] = []
        for item in sorted(sequences, key=lambda item: -_length(item)):
            free = next((r for r, used in enumerate(fill) if used + _length(item) <= self.pack_to), None)
            if free is None:
                rows.append([])
                fill.append(0)
                free = len(rows) - 1
            rows[free].append(item)
            fill[free] += _length(item)
        return rows

    def _packed(self, sequences: list[Sequence]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        rows = self._pack(sequences)
        shape = (len(rows), max(sum(_length(item) for item in row) for row in rows))
        inputs = torch.full(shape, self.pad_id, dtype=torch.long)
        targets = torch.full(shape, self.pad_id, dtype=torch.long)
        segments = torch.full(shape, -1, dtype=torch.long)
        mask, old, per_position = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        for r, row in enumerate(rows):
            at = 0
            for segment, (prompt, sample, advantage) in enumerate(row):
                n = self._place(inputs[r], targets[r], mask[r], old[r], at, prompt, sample)
                segments[r, at:at + n] = segment
                per_position[r, at:at + n] = advantage
                at += n
        return inputs, targets, mask, old, per_position, segments

    def micro_batches(self, sequences: list[Sequence]) -> list[list[Sequence]]:
        """The step's sequences cut, longest first, into runs of at most ``micro_batch_tokens`` positions as they
        will be laid out (padded: rows x the longest; packed: rows of ``pack_to``, first fit, x the fullest); one
        sequence over the budget is a micro-batch of its own. No budget: one micro-batch."""
        if not self.micro_batch_tokens:
            return [sequences]
        cuts: list[list[Sequence]] = []
        fill: list[int] = []  # the current cut's rows (padded: one per sequence)
        for item in sorted(sequences, key=lambda item: -_length(item)):
            n = _length(item)
            row = next((r for r, used in enumerate(fill) if used + n <= self.pack_to), None) if self.pack_to else None
            grown = [*fill, n] if row is None else [u + n if r == row else u for r, u in enumerate(fill)]
            if cuts and len(grown) * max(grown) <= self.micro_batch_tokens:
                cuts[-1].append(item)
                fill = grown
            else:
                cuts.append([item])
                fill = [n]
        return cuts

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST[self.precision])

    def step(self, groups: list[Group]) -> StepReport:
        started = time.perf_counter()
        if len(groups) < self.world:
            raise ValueError(f"{len(groups)} groups cannot be shared by {self.world} ranks")
        self.model.train()
        mine = groups[self.rank::self.world]
        local = sum(len(g.samples) for g in mine)
        everyone = sum(len(g.samples) for g in groups)
        scale = local * self.world / everyone  # DDP averages over ranks
        cuts = self.micro_batches(self.sequences(mine))
        self.optimizer.zero_grad()
        reports: list[tuple[LossReport, float]] = []
        for i, cut in enumerate(cuts):
            # DDP all-reduces on the last micro-batch's backward only: the others' gradients just accumulate.
            last = i == len(cuts) - 1
            with self._ddp.no_sync() if self._ddp is not None and not last else contextlib.nullcontext():
                loss, report, tokens = self._micro_step(cut, local)
                loss = loss * scale
                torch.autograd.backward(self.scaler.scale(loss) if self.scaler is not None else loss)
            reports.append((report, tokens))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.model.eval()
        self.version += 1
        rewards = [s.reward for g in groups for s in g.samples]
        tokens = sum(t for _r, t in reports)
        weight = max(tokens, 1.0)
        report = LossReport(loss=sum(r.loss for r, _t in reports),
                            entropy=sum(r.entropy * t for r, t in reports) / weight,
                            ratio_mean=sum(r.ratio_mean * t for r, t in reports) / weight,
                            ratio_clipped=sum(r.ratio_clipped * t for r, t in reports) / weight)
        return StepReport(version=self.version, loss=report, reward_mean=sum(rewards) / len(rewards),
                          sequences=len(rewards), tokens=int(tokens), seconds=time.perf_counter() - started,
                          micro_batches=len(cuts))

    def _micro_step(self, cut: list[Sequence], sequences: int) -> tuple[Tensor, LossReport, float]:
        """Forward and loss of one micro-batch, normalised by the step's ``sequences`` (so the micro-batches'
        losses add up to the step's); returns the trained positions too (the report's weights)."""
        with self._autocast():
            if self.pack_to:
                inputs, targets, mask, old, advantages, segments = (t.to(self.device) for t in self._packed(cut))
                logits = self._forward(inputs, segments)
            else:
                inputs, targets, mask, old, advantages = (t.to(self.device) for t in self._padded(cut))
                logits = self._logits_of(self._forward, inputs)
        loss, report = policy_loss(logits, targets, mask, old, advantages, self.temperature, self.max_ratio,
                                   self.entropy_coef, sequences=sequences)
        return loss, report, float(mask.sum())

    def logprobs(self, tokens: Tensor) -> Tensor:
        """Per-position log-probs of ``tokens`` [B, L] (position t scores token t+1), as the sampler computes them
        (on the CPU, whatever the trainer's device)."""
        tokens = tokens.to(self.device)
        with torch.no_grad(), self._autocast():
            logits = self._logits_of(self.model, tokens[:, :-1]).float()
        scaled = torch.log_softmax(logits / (self.temperature if self.temperature > 0 else 1.0), dim=-1)
        return scaled.gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2).cpu()

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """What to broadcast after a step, in a fixed order (on the trainer's device)."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()


def hf_logits(model: nn.Module, tokens: Tensor) -> Tensor:
    """``logits_of`` for a Hugging Face causal LM (its forward returns an output object). Rows are right-padded,
    and under causal attention a position never attends to the padding after it, so the real positions' logits need
    no attention mask (the padded positions' logits are masked out of the loss)."""
    logits: Tensor = model(input_ids=tokens).logits
    return logits
