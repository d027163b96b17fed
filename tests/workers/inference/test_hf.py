"""kiln's server with a Hugging Face causal LM (a tiny Llama and Qwen2 built here, with a tokenizer trained here):
the engine's per-token log-probs equal a teacher-forced forward of the same model while sequences of different
lengths join and leave the batch; over HTTP it takes token-id prompts and the model's chat template, answers with
token ids, log-probs and versions, decodes concurrent requests together, and an in-flight weight update changes the
version mid-sequence while the sequence goes on."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from kiln.workers.inference.engine import Engine, SamplingParams, sample_token
from kiln.workers.inference.hf_engine import HFDecoder, load_causal_lm
from kiln.workers.inference.model import token_logprobs, weights_digest
from kiln.workers.inference.process import ServerProcess
from kiln.workers.inference.tokenizer import load_tokenizer
from kiln.workers.inference.weights import WeightBroadcaster

torch.set_num_threads(1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_logprobs_equal_a_teacher_forced_forward(hf_model: Callable[..., Path], arch: str) -> None:
    path = hf_model(arch)
    model, tokenizer = load_causal_lm(str(path)), load_tokenizer(str(path))
    # A small cache to start with, so it grows while sequences run.
    engine = Engine(HFDecoder(model, slots=4, capacity=8), max_batch=4, tokenizer=tokenizer)
    prompts = ["1+2=", "def add(a, b):", "12+13=25\n3+4=", "7"]
    try:
        futures = [engine.submit(tokenizer.encode(p), SamplingParams(max_tokens=40 + 10 * i, temperature=0.8, seed=i,
                                                                      ignore_eos=True))
                   for i, p in enumerate(prompts[:2])]
        while engine.tokens_generated < 20:  # the others join a batch already running
            time.sleep(0.001)
        # two samples of one prompt share its prefill: the second's cache is a copy of the first's
        futures += engine.submit_many(tokenizer.encode(prompts[2]), [
            SamplingParams(max_tokens=50 + 10 * i, temperature=0.8, seed=i, ignore_eos=True) for i in (2, 4)])
        futures.append(engine.submit(tokenizer.encode(prompts[3]), SamplingParams(max_tokens=70, temperature=0.8,
                                                                                  seed=3, ignore_eos=True)))
        generations = [f.result(60) for f in futures]
    finally:
        engine.stop()
    assert engine.prefills == 4 and generations[2].tokens != generations[3].tokens
    for g in generations:
        assert len(g.tokens) == g.params.max_tokens
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([g.prompt + g.tokens])).logits[0, len(g.prompt) - 1:-1]
        trainer = token_logprobs(logits, 0.8).gather(1, torch.tensor(g.tokens).unsqueeze(1)).squeeze(1)
        assert torch.allclose(trainer, torch.tensor(g.logprobs), atol=1e-4)
    assert engine.decode_steps < sum(len(g.tokens) for g in generations)  # they were decoded together


def _served(serve: Callable[..., ServerProcess], path: Path) -> ServerProcess:
    return serve(KILN_RL_MODEL=str(path), KILN_RL_MODEL_NAME="tiny-hf")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_it_serves_token_ids_logprobs_and_versions(serve: Callable[..., ServerProcess],
                                                   hf_model: Callable[..., Path], arch: str) -> None:
    path = hf_model(arch)
    tokenizer = load_tokenizer(str(path))
    served = _served(serve, path)
    client = httpx.Client(base_url=served.url, timeout=60)
    prompt = tokenizer.encode("3+4=")
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": 2, "ignore_eos": True}
    answer = client.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    ids = choice["kiln"]["token_ids"]
    assert len(ids) == 12 and choice["kiln"]["token_versions"] == [0] * 12
    assert all(0 <= t < tokenizer.vocab_size for t in ids)
    assert choice["text"] == tokenizer.decode(ids)
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == 12 and all(lp <= 0 for lp in logprobs)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    # The same prompt as text is the same prompt: ids are taken as given, text is tokenised once.
    as_text = client.post("/v1/completions", json={**body, "prompt": "3+4="}).json()["choices"][0]
    assert as_text["kiln"]["token_ids"] == ids
    both = client.post("/v1/completions", json={**body, "prompt": [prompt, tokenizer.encode("1")]}).json()
    assert len(both["choices"]) == 2 and both["choices"][0]["kiln"]["token_ids"] == ids

    messages = [{"role": "user", "content": "2+2="}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "logprobs": True,
                                                     "seed": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokenizer.chat(messages))  # the model's chat template
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(chat["choices"][0]["kiln"]["token_ids"]) >= 1
    refused = client.post("/v1/completions", json={**body, "prompt": [tokenizer.vocab_size + 5]})
    assert refused.status_code == 400


def _complete(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = client.post("/v1/completions", json=body).json()
    return answer


def _replay(old: nn.Module, new: nn.Module, prompt: list[int], switch_at: int, n: int,
            seed: int) -> tuple[list[int], list[float]]:
    """What the server must have produced: ``old`` until token ``switch_at``, then ``new``'s parameters swapped in
    under the same KV cache; sampling with the request's seeded generator, as the engine does."""
    decoder = HFDecoder(old, slots=1)
    params = SamplingParams(max_tokens=n, seed=seed, ignore_eos=True)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        row = decoder.prefill(0, prompt)
        while True:
            token, lp = sample_token(row, params, generator)
            tokens.append(token)
            logprobs.append(float(lp[token]))
            if len(tokens) == n:
                return tokens, logprobs
            if len(tokens) == switch_at:
                swapped = dict(new.named_parameters())
                for name, param in old.named_parameters():
                    param.data = swapped[name].data
            row = decoder.decode([0], [token])[0]


def test_concurrent_requests_decode_together_and_an_update_lands_mid_sequence(
        serve: Callable[..., ServerProcess], hf_model: Callable[..., Path]) -> None:
    path = hf_model("llama")
    tokenizer = load_tokenizer(str(path))
    served = _served(serve, path)
    client = httpx.Client(base_url=served.url, timeout=120)
    prompt = tokenizer.encode("1+1=")

    steps_before = served.metric("kiln_inference_decode_steps_total")
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(_complete, client, {"prompt": prompt, "max_tokens": 40 * (i + 1), "seed": i,
                                                "ignore_eos": True}) for i in range(4)]
        answers = [r.result(120) for r in runs]
    tokens = sum(len(a["choices"][0]["kiln"]["token_ids"]) for a in answers)
    assert tokens == 40 + 80 + 120 + 160
    # Decoded together: far fewer steps than tokens (one after the other would take one step per token).
    assert served.metric("kiln_inference_decode_steps_total") - steps_before < 0.75 * tokens

    new = load_causal_lm(str(hf_model("llama", seed=1)))
    broadcaster = WeightBroadcaster([served.endpoint()], timeout_s=30)
    try:
        assert broadcaster.connect() == {}
        body = {"prompt": prompt, "max_tokens": 300, "seed": 7, "ignore_eos": True, "logprobs": 0}
        before = served.metric("kiln_inference_generated_tokens_total")
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_complete, client, body)
            while served.metric("kiln_inference_generated_tokens_total") < before + 50:
                time.sleep(0.005)
            report = broadcaster.update(new.named_parameters(), version=1)
            answer = running.result(120)
    finally:
        broadcaster.close()
    assert report.updated == [served.url] and report.failed == {}
    versions = answer["choices"][0]["kiln"]["token_versions"]
    switch_at = versions.index(1)
    assert 50 <= switch_at < 300 and versions == [0] * switch_at + [1] * (300 - switch_at)
    assert answer["kiln"] == {"version_start": 0, "version_end": 1}
    # Not restarted: the new weights continued the sequence on its kept KV cache, token for token.
    expected, expected_logprobs = _replay(load_causal_lm(str(path)), new, prompt, switch_at, 300, seed=7)
    assert answer["choices"][0]["kiln"]["token_ids"] == expected
    assert torch.allclose(torch.tensor(answer["choices"][0]["logprobs"]["token_logprobs"]),
                          torch.tensor(expected_logprobs), atol=1e-5)
    assert served.weights() == {"version": 1, "sha256": weights_digest(new)}
