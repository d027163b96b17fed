"""The policy-gradient objective (PipelineRL's): REINFORCE with a leave-one-out baseline per prompt group, a
truncated importance ratio against the sampler's log-probs, normalised by the number of sequences; an optional
entropy bonus (runs from scratch without one collapsed to the most frequent answer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def leave_one_out(rewards: Tensor) -> Tensor:
    """Advantages for the samples of one group: each reward minus the mean of the others' (zero for a lone sample)."""
    n = rewards.shape[-1]
    if n < 2:
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)


@dataclass
class LossReport:
    loss: float
    entropy: float
    ratio_mean: float
    ratio_clipped: float


def policy_loss(logits: Tensor, tokens: Tensor, mask: Tensor, old_logprobs: Tensor, advantages: Tensor,
                temperature: float = 1.0, max_ratio: float = 2.0,
                entropy_coef: float = 0.01, sequences: int | None = None) -> tuple[Tensor, LossReport]:
    """``logits`` [B, L, V] predict ``tokens`` [B, L] (already shifted); ``mask`` marks generated positions;
    ``old_logprobs`` are the sampler's; ``advantages`` [B] one per row, or [B, L] per position (packed rows hold
    several sequences). The ratio is truncated at ``max_ratio`` (its gradient stops there); the sum over the tokens is
    divided by ``sequences`` (default: one per row)."""
    logprobs_all = F.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    logprobs = logprobs_all.gather(2, tokens.unsqueeze(2)).squeeze(2)
    ratio = torch.exp(logprobs - old_logprobs)
    truncated = torch.clamp(ratio, max=max_ratio)
    per_token = -truncated * (advantages if advantages.dim() == 2 else advantages.unsqueeze(1))
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    per_token = per_token - entropy_coef * entropy
    loss = (per_token * mask).sum() / (sequences or tokens.shape[0])
    tokens_counted = mask.sum().clamp(min=1)
    report = LossReport(loss=float(loss.detach()), entropy=float((entropy.detach() * mask).sum() / tokens_counted),
                        ratio_mean=float((ratio.detach() * mask).sum() / tokens_counted),
                        ratio_clipped=float(((ratio > max_ratio).float() * mask).sum() / tokens_counted))
    return loss, report
