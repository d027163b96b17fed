"""The policy's two views agree: per-token log-probs from the KV-cache sampler (batched, sequences of different
lengths joining at different steps) equal the trainer's full forward pass; checkpoints round-trip through the blob
store bit for bit; continuous batching lets a short request finish while a long one runs."""

from __future__ import annotations

import time

import torch

from kiln.streams.blobstore import open_blob_store
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.engine import Engine, SamplingParams
from kiln.workers.inference.model import (
    TOKENIZER,
    ModelConfig,
    TinyLM,
    load_checkpoint,
    save_checkpoint,
    sequence_logprobs,
    weights_digest,
)

torch.set_num_threads(1)


def test_sampler_logprobs_equal_the_trainers_full_forward() -> None:
    model = TinyLM(ModelConfig(d_model=64, n_layers=2, n_heads=4, max_len=256, seed=3))
    engine = Engine(model, max_batch=8)
    try:
        prompts = ["a", "def f(x):", "theorem foo : 1 + 1 = 2 := by", "x" * 40, "print('hi')\n"]
        futures = [engine.submit(TOKENIZER.encode(p), SamplingParams(max_tokens=60 + 10 * i, temperature=0.8,
                                                                      seed=i))
                   for i, p in enumerate(prompts)]
        generations = [f.result(60) for f in futures]
    finally:
        engine.stop()
    width = max(len(g.prompt) + len(g.tokens) for g in generations)
    tokens = torch.zeros(len(generations), width, dtype=torch.long)
    for row, g in enumerate(generations):
        tokens[row, :len(g.prompt) + len(g.tokens)] = torch.tensor(g.prompt + g.tokens)
    with torch.no_grad():
        trainer = sequence_logprobs(model, tokens, [len(g.prompt) for g in generations], temperature=0.8)
    for row, g in enumerate(generations):
        start = len(g.prompt) - 1
        assert len(g.tokens) > 5
        assert torch.allclose(trainer[row, start:start + len(g.tokens)], torch.tensor(g.logprobs), atol=1e-4)
    assert engine.decode_steps < sum(len(g.tokens) for g in generations)  # they were decoded together


def test_a_groups_samples_share_one_prefill_and_sample_what_each_alone_would() -> None:
    """``submit_many``: the group's prompt is prefilled once per admission and its cache copied into the others'
    slots. Six slots for eight samples: the group is admitted in two parts; samples ending at their first token
    give their slot back to the next one at once. Each samples, with its own generator, the tokens ``submit`` gives
    it, and its log-probs are the trainer's full forward pass's (a wrong copy of the cache would change them)."""
    model = TinyLM(ModelConfig(d_model=64, n_layers=2, n_heads=4, max_len=128, seed=4))
    prompt = TOKENIZER.encode("12+30=")
    params = [SamplingParams(max_tokens=1 if i % 3 == 0 else 30, temperature=1.0, seed=7 + i) for i in range(8)]
    engines = [Engine(model, max_batch=6), Engine(model, max_batch=6)]  # each its own (empty) cache
    try:
        with engines[0].paused():  # admitted together, as the group is
            futures = [engines[0].submit(prompt, p) for p in params]
        alone = [f.result(60) for f in futures]
        with engines[1].paused():
            futures = engines[1].submit_many(prompt, params)
        together = [f.result(60) for f in futures]
    finally:
        for engine in engines:
            engine.stop()
    assert engines[0].prefills == 8 and engines[1].prefills == 2  # once per admission
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    assert [len(g.tokens) for g in together] == [p.max_tokens for p in params]
    tokens = torch.zeros(len(together), len(prompt) + 30, dtype=torch.long)
    for row, g in enumerate(together):
        tokens[row, :len(prompt) + len(g.tokens)] = torch.tensor(prompt + g.tokens)
    with torch.no_grad():
        trainer = sequence_logprobs(model, tokens, [len(prompt)] * len(together))
    for row, g in enumerate(together):
        start = len(prompt) - 1
        assert torch.allclose(trainer[row, start:start + len(g.tokens)], torch.tensor(g.logprobs), atol=1e-4)


def test_a_short_request_finishes_while_a_long_one_runs() -> None:
    engine = Engine(TinyLM(ModelConfig(max_len=1024)), max_batch=4)
    try:
        long = engine.submit(TOKENIZER.encode("long"), SamplingParams(max_tokens=900, temperature=0))
        while engine.tokens_generated < 50:
            time.sleep(0.001)
        short = engine.submit(TOKENIZER.encode("short"), SamplingParams(max_tokens=5, temperature=0))
        short.result(30)
        assert not long.done()  # the short one joined the running batch and left it first
        assert len(long.result(60).tokens) == 900
    finally:
        engine.stop()


def test_checkpoints_round_trip_through_the_blob_store(s3_settings: KilnSettings, unique: str) -> None:
    store = open_blob_store(s3_settings.model_copy(update={"blob_store": f"s3://kiln-test-{unique}/ckpt"}))
    model = TinyLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, seed=11))
    digest = save_checkpoint(model, store, version=7)
    loaded, version = load_checkpoint(store, digest)
    assert version == 7 and loaded.config == model.config
    assert weights_digest(loaded) == weights_digest(model)
    assert weights_digest(TinyLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, seed=12))) != weights_digest(model)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on() -> None:
    model = TinyLM(ModelConfig(max_len=64, seed=5))
    good = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = Engine(model, max_batch=4)
    try:
        with engine.paused():
            engine.load({name: torch.full_like(p, float("nan")) for name, p in good.items()}, version=1)
        broken = [engine.submit(TOKENIZER.encode("1+1="), SamplingParams(max_tokens=5, seed=i)) for i in range(3)]
        for fut in broken:
            try:
                fut.result(30)
                raise AssertionError("a NaN policy cannot sample")
            except RuntimeError:
                pass
        with engine.paused():
            engine.load(good, version=2)
        healed = [engine.submit(TOKENIZER.encode("1+1="), SamplingParams(max_tokens=5, seed=i)) for i in range(6)]
        assert all(len(f.result(30).tokens) >= 1 for f in healed)  # every slot was given back
        assert engine.running == 0
    finally:
        engine.stop()
