"""``kiln rl serve``: OpenAI-shaped completions with continuous batching, and PipelineRL's weight-update contract.

The completion routes answer in OpenAI's shapes, plus a ``kiln`` object per choice (the token ids sampled and the
policy version of every one) and per response (the version at start and end). The policy is kiln's character model
(``model="char"``) or a Hugging Face causal LM (``model`` = its directory), with its own tokenizer: completions take
text or token ids (as vLLM does), chat goes through the model's chat template. ``/init_process_group`` and
``/request_weight_update`` change the policy: they need the shared secret (``Authorization: Bearer``) and may be
served on a private address only. Both block until the trainer's side completes, so they run off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.workers.inference.engine import Engine, Generation, SamplingParams
from kiln.workers.inference.errors import PromptTooLong, WeightUpdateError, WeightUpdateRejected
from kiln.workers.inference.hf_engine import Dtype
from kiln.workers.inference.model import ModelShape, weights_digest
from kiln.workers.inference.tokenizer import CharTokenizer, PolicyTokenizer
from kiln.workers.inference.weights import InitProcessGroupRequest, UpdateTimings, WeightReceiver, WeightUpdateRequest

T = TypeVar("T")
REQUESTS = Counter("kiln_inference_requests_total", "Completion requests.", ["route"])
UPDATES = Counter("kiln_inference_weight_updates_total", "Weight updates, by outcome.", ["outcome"])


class InferenceSettings(BaseSettings, ModelShape):
    """``KILN_RL_*``: the server process's settings."""

    model_config = SettingsConfigDict(env_prefix="KILN_RL_", extra="ignore")

    host: str = Field("127.0.0.1", description="Bind address of the completion routes.")
    port: int = Field(8400, description="Port of the completion routes (and, unless admin_port, the admin ones).")
    admin_host: str = Field("127.0.0.1", description="Bind address of the weight-update routes (with admin_port).")
    admin_port: int = Field(0, description="A separate port for /init_process_group and /request_weight_update; "
                            "0 = serve them with the completions.")
    admin_token: str = Field("", description="Shared secret the weight-update routes require; empty refuses them.")
    model: str = Field("char", description="The policy: 'char' (kiln's TinyLM and character tokenizer) or the "
                       "directory of a Hugging Face causal LM (config, weights, tokenizer; loaded with transformers).")
    dtype: Dtype = Field("float32", description="A Hugging Face model's dtype (bfloat16/float16 where the device "
                         "has it).")
    device: str = Field("cpu", description="Where a Hugging Face model runs: 'cpu', 'cuda', 'cuda:1', ...")
    model_name: str = Field("kiln-tiny", description="The id /v1/models lists.")
    max_batch: int = Field(64, ge=1, description="Sequences decoded together at most.")
    staging: bool = Field(True, description="Receive weights into a staging buffer while decoding continues.")
    checkpoint: str = Field("", description="Blob-store digest of a safetensors checkpoint; empty = fresh init "
                            "of the shape KILN_RL_D_MODEL|N_LAYERS|N_HEADS|MAX_LEN|SEED (ModelShape). The "
                            "character model only.")


# ---- request and response shapes (OpenAI's, with kiln's extensions) ------------------------------------------

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields a small server has no use for

    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = Field(False, description="vLLM's extension: keep generating past the end-of-text token")

    def params(self, max_tokens: int | None, top: int, seed: int | None, index: int) -> SamplingParams:
        """Choice ``index`` of a prompt seeded with ``seed`` (the request's ``seed``, or its prompt's ``seeds``)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=max_tokens or 16, temperature=self.temperature, top_p=self.top_p,
                              seed=None if seed is None else seed + index, stop=stop, top_logprobs=top,
                              ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids (as vLLM takes them: tokenised once by the caller) or lists of them")
    logprobs: int | None = Field(None, ge=0, le=20)
    seeds: list[int] | None = Field(None, description="kiln's extension, instead of seed: a seed per prompt (prompt "
                                    "j's choice i samples with seeds[j] + i), so one request carries several groups, "
                                    "each sampled as its own request with its seed would be")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def prompt_ids(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: PolicyTokenizer) -> list[list[int]]:
    """A completion request's prompts as token ids: text is encoded, ids are taken as they are."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt if isinstance(p, int)]] if prompt else [[]]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt if not isinstance(p, int)]


def token_text(tokenizer: PolicyTokenizer, token: int) -> str:
    """One token as OpenAI's logprobs name it: the character tokenizer's own names (``<eos>`` too), a model's
    tokenizer's decoding of the token alone."""
    return tokenizer.token(token) if isinstance(tokenizer, CharTokenizer) else tokenizer.decode([token])


def _kiln(g: Generation) -> dict[str, Any]:
    return {"token_versions": g.versions, "version_start": g.version_start, "version_end": g.version_end,
            "token_ids": g.tokens}


def _usage(prompts: list[int], generations: list[Generation]) -> dict[str, int]:
    completion = sum(len(g.tokens) for g in generations)
    prompt = sum(prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _versions(generations: list[Generation]) -> dict[str, int]:
    return {"version_start": min(g.version_start for g in generations),
            "version_end": max(g.version_end for g in generations)}


def create_app(engine: Engine, settings: InferenceSettings, receiver: WeightReceiver | None = None,
               admin: bool = True, completions: bool = True) -> FastAPI:
    """The server's routes over ``engine``: the completion routes and/or the admin (weight-update) routes."""
    app = FastAPI(title="kiln inference")
    receiver = receiver or WeightReceiver(engine, staging=settings.staging)
    tokenizer = engine.tokenizer

    async def generate(prompts: list[list[int]], n: int,
                       make: Callable[[int, int], SamplingParams]) -> list[Generation]:
        """``n`` sequences of each prompt, the i-th of prompt j with ``make(j, i)``: each prompt's ``n`` share its
        prefill (``Engine.submit_many``)."""
        try:
            futures = [asyncio.wrap_future(f) for j, p in enumerate(prompts)
                       for f in engine.submit_many(p, [make(j, i) for i in range(n)])]
        except PromptTooLong as e:
            raise HTTPException(400, str(e)) from None
        return list(await asyncio.gather(*futures))

    @app.exception_handler(WeightUpdateError)
    async def weight_error(_request: Any, exc: WeightUpdateError) -> JSONResponse:
        status = 400 if isinstance(exc, WeightUpdateRejected) else 503
        return JSONResponse({"error": {"type": type(exc).__name__, "message": str(exc)}}, status_code=status)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "version": engine.version, "running": engine.running,
                "weight_group": receiver.group is not None}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    if completions:
        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                                "owned_by": "kiln", "kiln": {"version": engine.version}}]}

        @app.post("/v1/completions")
        async def completions_route(body: CompletionRequest) -> JSONResponse:
            REQUESTS.labels("completions").inc()
            vocab = engine.tokenizer.vocab_size
            requested = prompt_ids(body.prompt, tokenizer)
            if any(not 0 <= t < vocab for p in requested for t in p):
                raise HTTPException(400, f"prompt token ids must be in [0, {vocab})")
            if body.seeds is not None and (body.seed is not None or len(body.seeds) != len(requested)):
                raise HTTPException(400, f"seeds: one per prompt ({len(requested)}), instead of seed")
            seeds: list[int | None] = [*body.seeds] if body.seeds is not None else [body.seed] * len(requested)
            top = body.logprobs or 0
            gens = await generate(requested, body.n, lambda j, i: body.params(body.max_tokens, top, seeds[j], i))
            choices = []
            for index, g in enumerate(gens):
                choice: dict[str, Any] = {"index": index, "text": g.text, "finish_reason": g.finish_reason,
                                          "logprobs": None, "kiln": _kiln(g)}
                if body.logprobs is not None:
                    tokens = [token_text(tokenizer, t) for t in g.tokens]
                    offsets, at = [], 0
                    for t in tokens:
                        offsets.append(at)
                        at += len(t)
                    choice["logprobs"] = {
                        "tokens": tokens, "token_logprobs": g.logprobs, "text_offset": offsets,
                        "top_logprobs": [{token_text(tokenizer, i): v for i, v in top_k} for top_k in g.top_logprobs]
                        if top else None}
                choices.append(choice)
            # JSON as built: a returned dict would go through FastAPI's encoder first, value by value
            return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                 "created": int(time.time()), "model": settings.model_name, "choices": choices,
                                 "usage": _usage([len(p) for p in requested for _ in range(body.n)], gens),
                                 "kiln": _versions(gens)})

        @app.post("/v1/chat/completions")
        async def chat_route(body: ChatRequest) -> JSONResponse:
            REQUESTS.labels("chat").inc()
            prompt = tokenizer.chat([m.model_dump() for m in body.messages])
            top = body.top_logprobs or 0
            gens = await generate([prompt], body.n, lambda _j, i: body.params(
                body.max_completion_tokens or body.max_tokens, top, body.seed, i))
            choices = []
            for index, g in enumerate(gens):
                logprobs = None
                if body.logprobs:
                    logprobs = {"content": [
                        {"token": token_text(tokenizer, t), "logprob": lp,
                         "bytes": list(token_text(tokenizer, t).encode()),
                         "top_logprobs": [{"token": token_text(tokenizer, i), "logprob": v,
                                           "bytes": list(token_text(tokenizer, i).encode())}
                                          for i, v in (g.top_logprobs[k] if top else [])]}
                        for k, (t, lp) in enumerate(zip(g.tokens, g.logprobs, strict=True))]}
                choices.append({"index": index, "message": {"role": "assistant", "content": g.text},
                                "finish_reason": g.finish_reason, "logprobs": logprobs, "kiln": _kiln(g)})
            return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                 "created": int(time.time()), "model": settings.model_name, "choices": choices,
                                 "usage": _usage([len(prompt)] * body.n, gens), "kiln": _versions(gens)})

    if admin:
        def authorised(authorization: str = Header("")) -> None:
            expected = f"Bearer {settings.admin_token}"
            if not settings.admin_token or not hmac.compare_digest(authorization.encode(), expected.encode()):
                raise HTTPException(401, "the weight-update routes need the server's admin token")

        async def off_loop(fn: Callable[[], T], what: str) -> T:
            try:
                result = await asyncio.to_thread(fn)
            except WeightUpdateError:
                UPDATES.labels(what + "_failed").inc()
                raise
            UPDATES.labels(what).inc()
            return result

        @app.get("/weights", dependencies=[Depends(authorised)])
        async def weights() -> dict[str, Any]:
            """The policy version and a digest of the weights (see ``weights_digest``), read between two steps."""
            def read() -> str:
                with engine.paused():
                    return weights_digest(engine.model)
            return {"version": engine.version, "sha256": await asyncio.to_thread(read)}

        @app.post("/init_process_group", dependencies=[Depends(authorised)])
        async def init_process_group(body: InitProcessGroupRequest) -> dict[str, Literal[True]]:
            def join() -> None:
                try:
                    receiver.join(body)
                except RuntimeError as e:
                    raise WeightUpdateError(f"joining the weight group failed: {e}") from None
            await off_loop(join, "join")
            return {"ok": True}

        @app.post("/request_weight_update", dependencies=[Depends(authorised)])
        async def request_weight_update(body: WeightUpdateRequest) -> UpdateTimings:
            return await off_loop(lambda: receiver.update(body), "update")

    return app
