"""The policy-gradient objective: leave-one-out advantages, the truncated ratio (no gradient beyond it), sequences as
the normaliser, and one trainer step moving the policy toward rewarded samples."""

from __future__ import annotations

import torch

from kiln.rl.loss import leave_one_out, policy_loss
from kiln.rl.tasks import Addition, exact_match
from kiln.rl.trainer import Group, PolicyTrainer, Sample
from kiln.workers.inference.model import TOKENIZER, ModelConfig, TinyLM, sequence_logprobs

torch.set_num_threads(1)


def test_leave_one_out_baseline() -> None:
    advantages = leave_one_out(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(advantages, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.equal(leave_one_out(torch.tensor([1.0, 1.0])), torch.zeros(2))  # all equal: nothing to learn
    assert torch.equal(leave_one_out(torch.tensor([1.0])), torch.zeros(1))


def test_truncated_ratio_and_sequence_normaliser() -> None:
    logits = torch.zeros(2, 3, 5, requires_grad=True)  # uniform: log-prob ln(1/5) everywhere
    tokens = torch.tensor([[1, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    uniform = torch.log(torch.tensor(0.2))
    # Sequence 0 was far less likely under the sampler (ratio 10, truncated to 2); sequence 1 on-policy (ratio 1).
    unlikely = float(uniform - torch.log(torch.tensor(10.0)))
    old = torch.stack([torch.full((3,), unlikely), torch.full((3,), float(uniform))])
    loss, report = policy_loss(logits, tokens, mask, old, torch.tensor([1.0, 1.0]), max_ratio=2.0, entropy_coef=0.0)
    assert abs(report.loss - (-(3 * 2.0 + 1 * 1.0) / 2)) < 1e-5  # summed per sequence, averaged over sequences
    assert abs(report.ratio_clipped - 3 / 4) < 1e-6
    loss.backward()
    assert logits.grad is not None
    assert torch.count_nonzero(logits.grad[0]) == 0  # truncated: no gradient through the clipped ratio
    assert torch.count_nonzero(logits.grad[1, 0]) > 0 and torch.count_nonzero(logits.grad[1, 1:]) == 0  # masked


def test_a_step_moves_the_policy_toward_the_rewarded_sample() -> None:
    model = TinyLM(ModelConfig(max_len=16, seed=4))
    trainer = PolicyTrainer(model, lr=1e-2, entropy_coef=0.0)
    task = Addition().task(3, 4)
    prompt = TOKENIZER.encode(task.prompt)
    right, wrong = TOKENIZER.encode("7\n"), TOKENIZER.encode("9\n")
    assert exact_match(task, "7\n") == 1.0 and exact_match(task, "9\n") == 0.0 and exact_match(task, "77") == 0.0

    def logprob(completion: list[int]) -> float:
        with torch.no_grad():
            lp = sequence_logprobs(model, torch.tensor([prompt + completion]), [len(prompt)])
        return float(lp.sum())

    before = logprob(right) - logprob(wrong)
    samples = [Sample(c, [float(x) for x in sequence_logprobs(model, torch.tensor([prompt + c]),
                                                              [len(prompt)])[0, len(prompt) - 1:].detach()],
                      [0] * len(c), exact_match(task, TOKENIZER.decode(c))) for c in (right, wrong)]
    report = trainer.step([Group(prompt, samples)])
    assert report.version == 1 and report.sequences == 2 and report.reward_mean == 0.5
    assert logprob(right) - logprob(wrong) > before + 0.1
