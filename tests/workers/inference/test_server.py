"""``kiln rl serve`` answers the unmodified ``openai`` client (completions and chat, with logprobs, n, seed, stop
and usage), tags every token with its policy version, and refuses what it must."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from kiln.streams.blobstore import open_blob_store
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.model import TOKENIZER, ModelConfig, TinyLM, save_checkpoint, weights_digest
from kiln.workers.inference.process import ServerProcess


def test_the_openai_client_gets_completions_with_logprobs(serve: Callable[..., ServerProcess]) -> None:
    served = serve()
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["kiln-tiny"]

    first = client.completions.create(model="kiln-tiny", prompt="def add(a, b):", max_tokens=24, temperature=0.9,
                                      seed=5, logprobs=3)
    again = client.completions.create(model="kiln-tiny", prompt="def add(a, b):", max_tokens=24, temperature=0.9,
                                      seed=5, logprobs=3)
    choice = first.choices[0]
    assert choice.text == again.choices[0].text  # same seed, same sample
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    generated = len(choice.logprobs.token_logprobs)
    assert first.usage is not None and first.usage.completion_tokens == generated
    assert first.usage.prompt_tokens == len("def add(a, b):")
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert choice.logprobs.top_logprobs is not None and all(len(t) == 3 for t in choice.logprobs.top_logprobs)
    kiln = (choice.model_extra or {})["kiln"]
    assert kiln["token_versions"] == [0] * generated and (first.model_extra or {})["kiln"]["version_end"] == 0

    chat = client.chat.completions.create(model="kiln-tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=16, n=3, seed=1, logprobs=True, top_logprobs=2)
    assert len(chat.choices) == 3
    for c in chat.choices:
        assert c.message.role == "assistant"
        assert c.logprobs is not None and c.logprobs.content is not None
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert len({c.message.content for c in chat.choices}) > 1  # n samples, not one sample n times

    stopped = client.completions.create(model="kiln-tiny", prompt="x", max_tokens=200, temperature=1.5, seed=2,
                                        stop=["e"])
    text = stopped.choices[0].text
    assert "e" not in text and stopped.choices[0].finish_reason in ("stop", "length")


def test_it_refuses_what_it_must(serve: Callable[..., ServerProcess]) -> None:
    served = serve(ModelConfig(max_len=64))
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="kiln-tiny", prompt="y" * 80, max_tokens=4)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="kiln-tiny", prompt="y", max_tokens=4, temperature=-1)
    update = {"version": 1, "parameters_info": []}
    assert httpx.post(f"{served.url}/request_weight_update", json=update).status_code == 401
    assert httpx.post(f"{served.url}/request_weight_update", json=update,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    answer = httpx.post(f"{served.url}/request_weight_update", json=update,
                        headers={"Authorization": f"Bearer {served.token}"})
    assert answer.status_code == 503 and "init_process_group" in answer.text  # no group joined yet
    health = httpx.get(f"{served.url}/healthz").json()
    assert health["version"] == 0 and health["weight_group"] is False
    assert "kiln_inference_generated_tokens_total" in httpx.get(f"{served.url}/metrics").text


def test_it_serves_a_checkpoint_and_keeps_the_admin_routes_private(serve: Callable[..., ServerProcess],
                                                                     s3_settings: KilnSettings, unique: str) -> None:
    blob_store = f"s3://kiln-test-{unique}/ckpt"
    policy = TinyLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, seed=21))
    digest = save_checkpoint(policy, open_blob_store(s3_settings.model_copy(update={"blob_store": blob_store})),
                             version=12)
    admin_port = free_port()
    served = serve(ModelConfig(), KILN_RL_CHECKPOINT=digest, KILN_RL_ADMIN_PORT=str(admin_port),
                   KILN_BLOB_STORE=blob_store, KILN_S3_ENDPOINT=s3_settings.s3_endpoint or "",
                   KILN_S3_ACCESS_KEY=s3_settings.s3_access_key or "",
                   KILN_S3_SECRET_KEY=s3_settings.s3_secret_key or "", KILN_S3_REGION=s3_settings.s3_region)
    headers = {"Authorization": f"Bearer {served.token}"}
    # The policy-changing routes are not on the public port at all, only on the private one.
    assert httpx.get(f"{served.url}/weights", headers=headers).status_code == 404
    assert httpx.post(f"{served.url}/request_weight_update", headers=headers,
                      json={"version": 1, "parameters_info": []}).status_code == 404
    private = httpx.get(f"http://127.0.0.1:{admin_port}/weights", headers=headers, timeout=30).json()
    assert private == {"version": 12, "sha256": weights_digest(policy)}
    answer = httpx.post(f"{served.url}/v1/completions", json={"prompt": "a", "max_tokens": 3}).json()
    assert answer["kiln"] == {"version_start": 12, "version_end": 12}


def _completions_served(served: ServerProcess) -> float:
    """The server's ``kiln_inference_requests_total`` for the completions route."""
    for line in httpx.get(f"{served.url}/metrics", timeout=10).text.splitlines():
        if line.startswith('kiln_inference_requests_total{route="completions"}'):
            return float(line.split()[1])
    return 0.0


def test_one_request_carries_several_seeded_groups(serve: Callable[..., ServerProcess]) -> None:
    """kiln's ``seeds``: a seed per prompt of a list, each prompt's choices sampled as its own request with that seed
    would have them; a count that does not match the prompts, or seeds beside seed, is refused."""
    served = serve(ModelConfig(max_len=64))
    prompts, seeds = [TOKENIZER.encode(p) for p in ("1+2=", "30+4=", "5+5=")], [11, 2000, 7]
    sampling = {"max_tokens": 6, "temperature": 1.0, "n": 4, "logprobs": 0}
    with httpx.Client(base_url=served.url, timeout=60) as http:
        together = http.post("/v1/completions", json={"prompt": prompts, "seeds": seeds, **sampling}).json()
        alone = [http.post("/v1/completions", json={"prompt": p, "seed": s, **sampling}).json()
                 for p, s in zip(prompts, seeds, strict=True)]
        refused = [http.post("/v1/completions", json={"prompt": prompts, **sampling, **extra}).status_code
                   for extra in ({"seeds": [1, 2]}, {"seeds": seeds, "seed": 3})]
    assert [c["kiln"]["token_ids"] for c in together["choices"]] == [c["kiln"]["token_ids"] for a in alone
                                                                      for c in a["choices"]]
    assert len({tuple(c["kiln"]["token_ids"]) for c in together["choices"]}) > 3  # not one sample repeated
    assert together["usage"]["prompt_tokens"] == 4 * sum(len(p) for p in prompts)
    assert refused == [400, 400]


async def test_concurrent_generate_calls_share_requests(serve: Callable[..., ServerProcess]) -> None:
    """``KilnEndpoint.generate``: calls made while two requests are out wait and go together in one; each gets what
    it would have got alone, and a prompt the server refuses fails only its own call."""
    served = serve(ModelConfig(max_len=64))
    prompts = [TOKENIZER.encode(f"{a}+{a + 1}=") for a in range(24)]
    endpoint, alone_endpoint = served.endpoint(), served.endpoint()
    sampling: dict[str, Any] = {"n": 4, "max_tokens": 4, "temperature": 1.0, "top_p": 1.0}
    alone = [await alone_endpoint.generate(p, seed=100 * i, **sampling) for i, p in enumerate(prompts)]
    before = _completions_served(served)
    together = await asyncio.gather(*(endpoint.generate(p, seed=100 * i, **sampling) for i, p in enumerate(prompts)))
    assert _completions_served(served) - before <= 3  # two at once, then the other 22 in one
    assert [[t.token_ids for t in group] for group in together] == [[t.token_ids for t in group] for group in alone]
    assert [lp for group in together for t in group for lp in t.logprobs] == pytest.approx(
        [lp for group in alone for t in group for lp in t.logprobs], abs=1e-4)
    too_long = TOKENIZER.encode("9" * 80)
    answers = await asyncio.gather(*(endpoint.generate(p, seed=i, **sampling) for i, p in
                                     enumerate([prompts[0], prompts[1], prompts[2], too_long, prompts[3]])),
                                   return_exceptions=True)
    assert [type(a).__name__ for a in answers] == ["list", "list", "list", "HTTPStatusError", "list"]
