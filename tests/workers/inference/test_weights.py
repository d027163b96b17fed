"""PipelineRL's in-flight weight update, end to end over HTTP and gloo: a sequence in flight keeps its KV cache and
continues with the new weights (reconstructed here step by step from the model's own functions), the server ends
up with the trainer's weights bit for bit, and a server that dies mid-broadcast neither hangs the trainer nor
stays out after it comes back."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from kiln.workers.inference.engine import Engine, SamplingParams, sample_token
from kiln.workers.inference.errors import WeightUpdateRejected
from kiln.workers.inference.model import TOKENIZER, KVCache, ModelConfig, TinyLM, weights_digest
from kiln.workers.inference.process import ServerProcess
from kiln.workers.inference.weights import (
    InitProcessGroupRequest,
    TransferGroup,
    UpdateTimings,
    WeightBroadcaster,
    WeightReceiver,
    WeightUpdateRequest,
    join_group,
    receive,
)

torch.set_num_threads(1)
CONFIG = ModelConfig(max_len=1100, seed=0)
PROMPT = "theorem t : 2 + 2 = 4 := by"
SAMPLING = {"max_tokens": 1000, "temperature": 1.0, "seed": 1234, "ignore_eos": True, "logprobs": 0}


def _replay(old: TinyLM, new: TinyLM, prompt: list[int], switch_at: int, n: int) -> tuple[list[int], list[float]]:
    """What the server must have produced: prefill and decode with ``old`` until token ``switch_at``, then decode
    with ``new`` on the same KV cache; sampling with the request's seeded generator, as the engine does."""
    params = SamplingParams(max_tokens=n, temperature=1.0, seed=1234, ignore_eos=True)
    generator = torch.Generator().manual_seed(1234)
    cache = KVCache(CONFIG, 64)  # the server's max_batch; the sequence sits in slot 0, as there
    slots = torch.tensor([0])
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        logits, keys, values = old.prefill(torch.tensor([prompt]))
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            cache.keys[layer, 0, :, :len(prompt)] = k[0]
            cache.values[layer, 0, :, :len(prompt)] = v[0]
        cache.lengths[0] = len(prompt)
        row = logits[0, -1]
        while True:
            token, lp = sample_token(row, params, generator)
            tokens.append(token)
            logprobs.append(float(lp[token]))
            if len(tokens) == n:
                return tokens, logprobs
            model = old if len(tokens) < switch_at else new
            row = model.decode(torch.tensor([token]), cache, slots)[0]


def test_an_update_lands_mid_sequence_and_the_sequence_continues(serve: Callable[..., ServerProcess]) -> None:
    served = serve(CONFIG)
    client = httpx.Client(base_url=served.url, timeout=120)
    reference = client.post("/v1/completions", json={"prompt": PROMPT, **SAMPLING}).json()["choices"][0]

    old, new = TinyLM(CONFIG), TinyLM(CONFIG.model_copy(update={"seed": 1}))
    broadcaster = WeightBroadcaster([served.endpoint()], timeout_s=30)
    assert broadcaster.connect() == {}
    before = served.metric("kiln_inference_generated_tokens_total")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: client.post("/v1/completions", json={"prompt": PROMPT, **SAMPLING}).json())
        while served.metric("kiln_inference_generated_tokens_total") < before + 150:
            time.sleep(0.005)
        report = broadcaster.update(new.named_parameters(), version=1)
        answer = running.result(120)
    assert report.updated == [served.url] and report.failed == {}
    choice = answer["choices"][0]
    versions, tokens = choice["kiln"]["token_versions"], choice["kiln"]["token_ids"]
    switch_at = versions.index(1)
    assert 150 <= switch_at < 1000 and versions == [0] * switch_at + [1] * (1000 - switch_at)
    assert answer["kiln"] == {"version_start": 0, "version_end": 1}
    # Before the update: exactly the reference run on the old weights; not restarted: one sequence of 1000.
    assert tokens[:switch_at] == reference["kiln"]["token_ids"][:switch_at]
    assert tokens[switch_at:] != reference["kiln"]["token_ids"][switch_at:]
    # After it: the new weights on the kept KV cache, token for token.
    expected, expected_logprobs = _replay(old, new, TOKENIZER.encode(PROMPT), switch_at, 1000)
    assert tokens == expected
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), torch.tensor(expected_logprobs),
                          atol=1e-5)
    assert served.weights() == {"version": 1, "sha256": weights_digest(new)}
    broadcaster.close()


def test_a_server_dying_mid_broadcast_does_not_hang_the_trainer_and_rejoins(
        serve: Callable[..., ServerProcess]) -> None:
    first, second = serve(), serve()
    broadcaster = WeightBroadcaster([first.endpoint(timeout_s=15), second.endpoint(timeout_s=15)], timeout_s=15)
    assert broadcaster.connect() == {}
    policy = TinyLM(ModelConfig(seed=5))
    report = broadcaster.update(policy.named_parameters(), version=1)
    assert sorted(report.updated) == sorted([first.url, second.url])
    assert first.weights() == second.weights() == {"version": 1, "sha256": weights_digest(policy)}

    # The second server freezes, then dies while the trainer is sending it version 2.
    assert second.proc is not None
    second.proc.send_signal(signal.SIGSTOP)
    threading.Timer(1.0, second.kill).start()
    policy = TinyLM(ModelConfig(seed=6))
    started = time.monotonic()
    report = broadcaster.update(policy.named_parameters(), version=2)
    assert time.monotonic() - started < 20  # a typed failure within the timeout, not a hang
    assert report.updated == [first.url] and second.url in report.failed
    assert "WeightUpdateError" in report.failed[second.url]
    assert first.weights() == {"version": 2, "sha256": weights_digest(policy)}

    # While it is down the trainer goes on; once it is back, the next update brings it into a new group.
    policy = TinyLM(ModelConfig(seed=7))
    report = broadcaster.update(policy.named_parameters(), version=3)
    assert report.updated == [first.url] and second.url in report.failed
    second.restart()
    policy = TinyLM(ModelConfig(seed=8))
    report = broadcaster.update(policy.named_parameters(), version=4)
    assert sorted(report.updated) == sorted([first.url, second.url]) and report.failed == {}
    assert first.weights() == second.weights() == {"version": 4, "sha256": weights_digest(policy)}
    broadcaster.close()


class TwoRankEngine:
    """An engine of two ranks, as vLLM or SGLang with tensor parallelism 2 joins: each rank (a thread here, a
    worker process there) joins the trainer's group with its own rank and receives every broadcast."""

    packs = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.groups: list[TransferGroup] = []
        self.received: list[dict[str, torch.Tensor]] = []

    def health(self) -> dict[str, Any]:
        return {}

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        with ThreadPoolExecutor(2) as ranks:
            self.groups = list(ranks.map(lambda local: join_group(request, local), range(2)))

    def request_weight_update(self, request: WeightUpdateRequest) -> UpdateTimings | None:
        with ThreadPoolExecutor(2) as ranks:
            self.received = list(ranks.map(lambda group: receive(group, request), self.groups))
        return None


def test_an_engine_of_two_ranks_joins_one_group_and_every_rank_receives() -> None:
    engine = TwoRankEngine("http://tp2-engine")
    broadcaster = WeightBroadcaster([engine], timeout_s=30, ranks={engine.url: 2})
    try:
        assert broadcaster.connect() == {}
        assert sorted(g.rank for g in engine.groups) == [1, 2]  # the trainer is rank 0 of a world of 3
        policy = TinyLM(ModelConfig(seed=9))
        report = broadcaster.update(policy.named_parameters(), version=3)
    finally:
        broadcaster.close()
    assert report.updated == [engine.url] and report.failed == {}
    expected = dict(policy.named_parameters())
    for received in engine.received:
        assert received.keys() == expected.keys()
        assert all(torch.equal(received[name], expected[name]) for name in expected)


def test_a_one_rank_server_refuses_a_group_that_waits_for_more_ranks() -> None:
    engine = Engine(TinyLM(ModelConfig()), max_batch=2)
    try:
        request = InitProcessGroupRequest(master_address="127.0.0.1", master_port=1, rank=1, world_size=3)
        with pytest.raises(WeightUpdateRejected, match="one rank"):  # at once, not after a rendezvous timeout
            WeightReceiver(engine).join(request)
    finally:
        engine.stop()
