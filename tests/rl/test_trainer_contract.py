"""The trainer contract beyond kiln's own model: a Hugging Face causal LM (a tiny randomly initialised GPT-2 built
here) learns from rewards through the same ``PolicyTrainer``, and two data-parallel ranks (DDP over gloo, separate
processes) produce the single-process gradient over the whole batch."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import GPT2Config, GPT2LMHeadModel

from kiln.rl.trainer import Group, PolicyTrainer, Sample, hf_logits
from kiln.streams.processes import free_port
from kiln.workers.inference.model import TOKENIZER, ModelConfig, TinyLM


def _groups(trainer: PolicyTrainer, seed: int = 0) -> list[Group]:
    """Six prompts, four samples each: "right" completions rewarded, the rest not; log-probs from the policy."""
    rng = random.Random(seed)
    groups = []
    for i in range(6):
        prompt = TOKENIZER.encode(f"{i}+{i}=")
        samples = []
        for j in range(4):
            completion = TOKENIZER.encode(str(2 * i) if j % 2 == 0 else str(rng.randrange(10, 99)))
            tokens = torch.tensor([prompt + completion])
            old = trainer.logprobs(tokens)[0, len(prompt) - 1:].tolist()
            samples.append(Sample(completion, old, [0] * len(completion), 1.0 if j % 2 == 0 else 0.0))
        groups.append(Group(prompt, samples))
    return groups


def _rewarded_logprob(trainer: PolicyTrainer, groups: list[Group]) -> float:
    total = 0.0
    for g in groups:
        right = g.samples[0].completion
        total += float(trainer.logprobs(torch.tensor([g.prompt + right]))[0, len(g.prompt) - 1:].sum())
    return total


def test_a_hugging_face_causal_lm_learns_through_the_contract() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=TOKENIZER.vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=TOKENIZER.BOS, eos_token_id=TOKENIZER.EOS)
    trainer = PolicyTrainer(GPT2LMHeadModel(config), lr=3e-3, entropy_coef=0.0, logits_of=hf_logits)
    groups = _groups(trainer)
    before = _rewarded_logprob(trainer, groups)
    for _ in range(20):
        report = trainer.step(_groups(trainer))
    assert report.version == 20 and report.reward_mean == 0.5
    after = _rewarded_logprob(trainer, groups)
    assert after > before + 2.0, (before, after)  # the rewarded answers became likelier (summed over 6 prompts)
    names = [name for name, _ in trainer.named_weights()]
    assert names == [name for name, _ in trainer.model.named_parameters()]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trainer = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01, rank=rank, world=world)
        trainer.step(_groups(trainer))
        torch.save({n: p.grad for n, p in trainer.model.named_parameters()}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_data_parallel_ranks_give_the_single_process_gradient(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    single = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01)
    single.step(_groups(single))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, p in single.model.named_parameters():
        assert p.grad is not None
        for grads in ranks:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
    # The ranks trained on different halves: each half alone gives another gradient.
    half = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01)
    half.step(_groups(half)[0::2])
    assert any(not torch.allclose(q.grad, ranks[0][n], atol=1e-6)  # type: ignore[arg-type]
               for n, q in half.model.named_parameters())


def test_packed_rows_give_the_padded_gradient_with_fewer_rows() -> None:
    padded = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01)
    packed = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01, pack_to=32)
    groups = _groups(padded)
    padded.step(groups)
    packed.step(groups)
    for (name, p), q in zip(padded.model.named_parameters(), packed.model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    rows = packed.packed_batch(groups)[0]
    assert rows.shape[0] < sum(len(g.samples) for g in groups) and rows.shape[1] <= 32


def test_micro_batches_to_a_token_budget_give_the_one_batch_gradient() -> None:
    torch.set_num_threads(1)
    for pack_to in (0, 16):
        whole = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01, pack_to=pack_to)
        micro = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01, pack_to=pack_to,
                              micro_batch_tokens=24)
        groups = _groups(whole)
        cuts = micro.micro_batches(micro.sequences(groups))
        assert len(cuts) > 3 and sum(len(c) for c in cuts) == 24  # every sequence once, in several cuts
        if not pack_to:
            assert all(len(c) * max(len(p) + len(s.completion) - 1 for p, s, _a in c) <= 24 for c in cuts)
        one, many = whole.step(groups), micro.step(groups)
        assert (one.micro_batches, many.micro_batches) == (1, len(cuts))
        assert abs(one.loss.loss - many.loss.loss) < 1e-5 and abs(one.loss.entropy - many.loss.entropy) < 1e-5
        assert one.tokens == many.tokens
        for (name, p), q in zip(whole.model.named_parameters(), micro.model.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_mixed_precision_steps_keep_float32_weights() -> None:
    """bf16 and fp16 autocast (CPUs have both) train float32 master weights: what is broadcast and checkpointed stays
    float32, and the step's gradient (fp16's unscaled by its gradient scaler) is close to the float32 one."""
    torch.set_num_threads(1)
    exact = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01)
    groups = _groups(exact)
    exact.step(groups)
    flat = torch.cat([p.grad.flatten() for p in exact.model.parameters() if p.grad is not None])
    for precision in ("bf16", "fp16"):
        mixed = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), entropy_coef=0.01, precision=precision,
                              micro_batch_tokens=64)
        report = mixed.step(groups)
        assert report.version == 1 and report.micro_batches > 1
        assert (mixed.scaler is not None) == (precision == "fp16")
        assert all(t.dtype == torch.float32 for _n, t in mixed.named_weights())
        approx = torch.cat([p.grad.flatten() for p in mixed.model.parameters() if p.grad is not None])
        assert torch.nn.functional.cosine_similarity(flat, approx, dim=0) > 0.95, precision
        assert not torch.equal(flat, approx), precision  # the reduced precision really ran
