"""The rollout stage against vLLM- and SGLang-shaped servers, token in, token out, with a Hugging Face tokenizer
(``hf.build_tiny_model``): the prompt is tokenised once (the chat template) and sent as ids, each engine's own
fields come back as the sample's ids, log-probs and versions, and the ids the trainer gets are the ids sampled —
for single-turn groups and for multi-turn episodes whose tool output is appended as tokens.

The servers are small FastAPI apps on loopback that answer exactly as the engines' code builds its answers (read
from the wheels tests/workers/inference/test_adapters.py fetches, vllm 0.33.0 and sglang 0.5.23):

vLLM, ``POST /v1/completions`` (``vllm/entrypoints/openai/completion/api_router.py`` ``create_completion``:
``JSONResponse(content=CompletionResponse.model_dump())``), the body from ``completion/serving.py``
``OpenAIServingCompletion.request_output_to_completion_response``: one ``CompletionResponseChoice``
(``completion/protocol.py``) per output with ``index``, ``text``, ``logprobs`` (``_create_completion_logprobs``:
``text_offset``, ``token_logprobs``, ``tokens``, ``top_logprobs``; only when the request sets ``logprobs``),
``finish_reason``, ``stop_reason``, ``prompt_logprobs``, ``prompt_token_ids`` and ``token_ids`` (only with
``return_token_ids``), ``routed_experts``, ``weight_versions`` (only with ``return_weight_versions``:
``vllm/outputs.py`` ``WeightVersionSpan(version, start, end)`` from ``v1/engine/output_processor.py``
``_weight_version_spans``; the label before any update is ``"default"``, ``v1/engine/core.py``); then ``usage``
(``UsageInfo``) and the response's ``id``, ``object``, ``created``, ``model``, ``service_tier``,
``system_fingerprint``, ``kv_transfer_params``, ``ec_transfer_params``, ``metrics``.

SGLang, ``POST /generate`` (``sglang/srt/entrypoints/http_server.py`` ``generate_request`` →
``serve_generate_request``: ``orjson_response`` of ``tokenizer_manager.generate_request``'s first item), each
output from ``managers/tokenizer_manager.py`` ``_handle_batch_output``: ``{"text", "output_ids", "meta_info"}``,
``meta_info`` with ``id``, ``finish_reason`` (``managers/schedule_batch.py`` ``FINISH_MATCHED_TOKEN.to_json``:
``{"type": "stop", "matched": id}``; ``FINISH_LENGTH``: ``{"type": "length", "length": n}``), ``prompt_tokens``,
``weight_version``, ``num_retractions``, with ``return_logprob`` (``add_logprob_to_meta_info``,
``detokenize_logprob_tokens``) ``input_token_logprobs``, ``output_token_logprobs`` as ``(logprob, id, None)``
and ``output_token_logprobs_length``, then ``reasoning_tokens``, ``completion_tokens``, ``cached_tokens``,
``weight_versions`` (``utils/weight_versions.py`` ``add_weight_versions_to_meta_info``), and
``response_sent_to_client_ts`` (``_wait_one_response``). A request with n > 1 parallel samples, or a batch of
prompts, is answered with a list (``_handle_batch_request``: ``_collect_batch_responses``). ``output_ids`` run
through the stop token (``scheduler_components/output_streamer.py``: ``output_ids_through_stop``).

The fake policy writes each answer one character per token although the tokenizer has merges for them (``"12"``
is one token when the text is tokenised), so re-tokenising the text would not give the sampled ids: equality
below is the sampler's ids reaching the group, not a round trip.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request

from kiln.rl.tasks import Addition, exact_match
from kiln.schemas.rl import RolloutGroup, RolloutRequest, RolloutTask, Sampling
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.endpoints import Turn, span_versions
from kiln.workers.inference.errors import EndpointAnswerError
from kiln.workers.inference.hf import build_tiny_model
from kiln.workers.inference.tokenizer import HFTokenizer, load_tokenizer, tokenize_prompt
from tests.loopback import serving
from tests.stages import worker_env
from tests.streams.harness import read_all
from tests.workers.exec.conftest import exec_worker

UPDATED = "5"  # the weight label an update mid-answer brings: the first token was sampled by "default" (version 0)
CORPUS = [f"add {a}+{b}={a + b}\n" for a in range(20) for b in range(20)] + ["<run>echo 12</run>"] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny", CORPUS)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> HFTokenizer:
    loaded = load_tokenizer(str(model_dir))
    assert isinstance(loaded, HFTokenizer)
    return loaded


@dataclass
class Call:
    prompt: list[int]
    sampled: list[list[int]]
    body: dict[str, Any]


@dataclass
class FakeEngine:
    """vLLM or SGLang on loopback; its policy answers from the prompt's text (``policy``), one token a character,
    ending with the EOS; every call is recorded."""

    kind: str
    tokenizer: HFTokenizer
    policy: Callable[[str, int], str]
    calls: list[Call] = field(default_factory=list)

    def sample(self, prompt: list[int], index: int) -> tuple[str, list[int], list[float]]:
        answer = self.policy(self.tokenizer.decode(prompt), index)
        ids = [t for c in answer for t in self.tokenizer.encode(c)] + [self.tokenizer.eos_id]
        assert len(ids) == len(answer) + 1, "every character is one token of the byte-level alphabet"
        return answer, ids, [-0.25 * (1 + i % 3) for i in range(len(ids))]

    def vllm(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt), "a token-id prompt"
        choices, sampled = [], []
        for index in range(body.get("n", 1)):
            text, ids, logprobs = self.sample(prompt, index)
            sampled.append(ids)
            tokens = [self.tokenizer.decode([t]) for t in ids]
            offsets = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))
            choices.append({
                "index": index, "text": text,
                "logprobs": None if body.get("logprobs") is None else {
                    "text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
                    "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]},
                "finish_reason": "stop", "stop_reason": None, "prompt_logprobs": None,
                "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                "token_ids": ids if body.get("return_token_ids") else None, "routed_experts": None,
                "weight_versions": [{"version": "default", "start": 0, "end": 1},
                                    {"version": UPDATED, "start": 1, "end": len(ids)}]
                if body.get("return_weight_versions") else None})
        self.calls.append(Call(prompt, sampled, body))
        completion = sum(len(s) for s in sampled)
        return {"id": "cmpl-1", "object": "text_completion", "created": int(time.time()), "model": "tiny",
                "choices": choices, "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + completion,
                          "completion_tokens": completion, "prompt_tokens_details": None,
                          "completion_tokens_details": None},
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}

    def sglang(self, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        batch = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batch else [body["input_ids"]]
        params = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
        n = params[0].get("n", 1)
        outs, sampled = [], []
        for index, (prompt, _param) in enumerate(itertools.product(prompts, range(n))):
            text, ids, logprobs = self.sample(prompt, index)
            sampled.append(ids)
            meta: dict[str, Any] = {"id": f"rid-{index}", "finish_reason": {"type": "stop", "matched": ids[-1]},
                                    "prompt_tokens": len(prompt), "weight_version": UPDATED, "num_retractions": 0}
            if body.get("return_logprob"):
                meta.update({"input_token_logprobs": [], "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
                    "output_token_logprobs_length": len(ids)})
            meta.update({"reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": 0,
                         "weight_versions": [{"version": "default", "start": 0, "end": 1},
                                             {"version": UPDATED, "start": 1, "end": len(ids)}],
                         "weight_version": UPDATED, "response_sent_to_client_ts": time.time()})
            outs.append({"text": text, "output_ids": ids, "meta_info": meta})
        self.calls.append(Call(prompts[0], sampled, body))
        return outs if batch or n > 1 else outs[0]


@pytest.fixture
def engine(request: pytest.FixtureRequest, tokenizer: HFTokenizer) -> Iterator[tuple[FakeEngine, str]]:
    """``(engine, url)`` for the kind ``request.param`` with the policy ``policy`` (module attribute below)."""
    kind, policy = request.param
    fake = FakeEngine(kind, tokenizer, policy)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {}

    @app.post("/v1/completions" if kind == "vllm" else "/generate")
    async def answer(raw: Request) -> Any:
        body = await raw.json()
        return fake.vllm(body) if kind == "vllm" else fake.sglang(body)

    with serving(app) as url:
        yield fake, url


def addition(prompt: str, index: int) -> str:
    """The right sum for even samples, one too many for odd ones."""
    found = re.search(r"(\d+)\+(\d+)=", prompt)
    assert found, prompt
    return str(int(found[1]) + int(found[2]) + index % 2)


def tool_user(prompt: str, index: int) -> str:
    """First a tool call, then the number the tool printed."""
    printed = re.findall(r"<output>\n(\d+)\n\[exit 0\]\n</output>", prompt)
    return printed[-1] if printed else "<run>echo 12</run>"


def test_span_labels_are_versions_and_an_answer_must_cover_every_token() -> None:
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 5}]
    assert span_versions(spans, 5, fallback=3) == [0, 0, 7, 7, 7]
    assert span_versions(spans[:1], 4, fallback=3) == [0, 0, 3, 3]  # tokens no span covers: the fallback
    assert span_versions(None, 2, fallback=3) == [3, 3]
    with pytest.raises(EndpointAnswerError, match="one of each per token"):
        Turn("ab", [1, 2], [-0.1], [0, 0], "stop")


def _env(settings: KilnSettings, url: str, kind: str, model_dir: Path) -> dict[str, str]:
    return worker_env(settings, KILN_ROLLOUT_ENDPOINTS=json.dumps([url]), KILN_ROLLOUT_ENDPOINT_KIND=kind,
                      KILN_ROLLOUT_MODEL=str(model_dir))


@pytest.mark.parametrize("engine", [("vllm", addition), ("sglang", addition)], ids=["vllm", "sglang"],
                         indirect=True)
async def test_single_turn_groups_carry_the_sampled_tokens(engine: tuple[FakeEngine, str],
                                                           stage_topics: Callable[..., KilnSettings],
                                                           model_dir: Path, tokenizer: HFTokenizer,
                                                           unique: str) -> None:
    fake, url = engine
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1))
    tasks = [Addition(1).task(a, b) for a, b in ((1, 2), (7, 5), (9, 9))]
    with WorkerProcess("rollout", settings, "rollout.requests", slots=4,
                       env=_env(settings, url, fake.kind, model_dir)) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, f"actor-{unique}") as client:
            groups: list[RolloutGroup] = [await client.call("rollout", RolloutRequest(
                task=t, sampling=Sampling(n=4, max_tokens=8, seed=None if i else 11))) for i, t in enumerate(tasks)]
        worker.stop()
    for task, group, call in zip(tasks, groups, fake.calls, strict=True):
        # Tokenised once, through the chat template, and sent as ids.
        assert group.prompt_ids == call.prompt == tokenize_prompt(tokenizer, task.prompt)
        assert str(tokenizer.tokenizer.decode(group.prompt_ids)).startswith("<|im_start|>user\n")
        assert [s.token_ids for s in group.samples] == call.sampled
        for i, sample in enumerate(group.samples):
            assert sample.logprobs == [-0.25 * (1 + j % 3) for j in range(len(sample.token_ids))]
            assert sample.versions == [0] + [int(UPDATED)] * (len(sample.token_ids) - 1)
            assert sample.token_ids[-1] == tokenizer.eos_id and sample.finish_reason == "stop"
            assert sample.reward == exact_match(task, sample.text) == (1.0 if i % 2 == 0 else 0.0)
        assert (group.version_start, group.version_end) == (0, int(UPDATED))
    # The sampled ids are not what tokenising the text gives: the group carries the sampler's, not a round trip.
    assert any(tokenizer.encode(tokenizer.decode(s.token_ids)) != s.token_ids
               for g in groups for s in g.samples)
    seeded = fake.calls[0].body
    assert (seeded.get("seed") == 11) if fake.kind == "vllm" else \
        ([p["sampling_seed"] for p in seeded["sampling_params"]] == [11, 12, 13, 14])
    assert read_all(settings, settings.topic("rollout.requests.dlq")) == []
    published = read_all(settings, settings.topic("rollouts"), expect=len(tasks))
    assert sorted(RolloutGroup.model_validate_json(m.value()).model_dump_json() for m in published) == \
        sorted(g.model_dump_json() for g in groups)


@pytest.mark.parametrize("engine", [("vllm", addition)], ids=["vllm"], indirect=True)
async def test_an_engine_answer_without_token_ids_is_refused_not_dead_lettered(
        engine: tuple[FakeEngine, str], stage_topics: Callable[..., KilnSettings], model_dir: Path,
        unique: str) -> None:
    """The stage configured for kiln's server against vLLM: vLLM's answer has no ``kiln`` extension, and the
    requester is told so (once, no retries) rather than the group dead-lettering after a KeyError."""
    _fake, url = engine
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1))
    with WorkerProcess("rollout", settings, "rollout.requests", slots=2,
                       env=_env(settings, url, "kiln", model_dir)) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, f"actor-{unique}") as client:
            with pytest.raises(RequestFailed, match=r"RoutineJobError.*no kiln\.token_ids"):
                await client.call("rollout", RolloutRequest(task=Addition(1).task(1, 2)))
        worker.stop()
    assert read_all(settings, settings.topic("rollout.requests.dlq")) == []


@pytest.mark.docker
@pytest.mark.parametrize("engine", [("vllm", tool_user), ("sglang", tool_user)], ids=["vllm", "sglang"],
                         indirect=True)
async def test_multi_turn_transcripts_are_token_sequences(engine: tuple[FakeEngine, str],
                                                          stage_topics: Callable[..., KilnSettings],
                                                          project_image: str, model_dir: Path,
                                                          tokenizer: HFTokenizer, tmp_path: Path,
                                                          unique: str) -> None:
    """Each turn's prompt is the prompt ids and every token so far — the sampled ids and the tool output's ids,
    never re-tokenised text — and the sample is exactly that sequence's completion."""
    fake, url = engine
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1), ("exec.requests", 2))
    task = RolloutTask(task_id="echo", prompt="what does echo 12 print?", answer="12", check={"image": project_image},
                max_turns=3)
    with exec_worker(settings, tmp_path / "locks") as ex, \
            WorkerProcess("rollout", settings, "rollout.requests", slots=2,
                          env=_env(settings, url, fake.kind, model_dir)) as worker:
        ex.wait_assigned()
        worker.wait_assigned()
        async with KilnClient(settings, f"trainer-{unique}") as client:
            group: RolloutGroup = await client.call("rollout", RolloutRequest(
                task=task, sampling=Sampling(n=2, max_tokens=32)))
        worker.stop()
    tool_ids = tokenizer.encode("\n<output>\n12\n[exit 0]\n</output>\n")
    firsts = [c for c in fake.calls if c.prompt == group.prompt_ids]
    seconds = [c for c in fake.calls if c.prompt != group.prompt_ids]
    assert len(firsts) == len(seconds) == 2 and group.prompt_ids == tokenize_prompt(tokenizer, task.prompt)
    for sample, first, second in zip(group.samples, firsts, seconds, strict=True):
        [turn1], [turn2] = first.sampled, second.sampled
        assert second.prompt == group.prompt_ids + turn1 + tool_ids  # the next turn's prompt: tokens so far
        assert sample.token_ids == turn1 + tool_ids + turn2  # what the trainer gets: the sampled ids, in order
        assert sample.tool_mask == [0] * len(turn1) + [1] * len(tool_ids) + [0] * len(turn2)
        # each turn: its first token before the update, the rest after; the tool's tokens: the turn's last version
        updated = int(UPDATED)
        assert sample.versions == [0] + [updated] * (len(turn1) - 1 + len(tool_ids)) + [0] + [updated] * (
            len(turn2) - 1)
        assert (sample.turns, sample.reward, sample.text.endswith("12")) == (2, 1.0, True)
