"""``InferenceEndpoint``: the one way actors and trainers reach an inference server, whatever serves it.

Rollouts are token in, token out: ``generate`` sends the prompt as token ids (tokenised once, by the caller, with
the model's tokenizer) and reads back each engine's own fields for the sampled ids, their log-probs and the weight
version that sampled each one, as ``Turn``s — nothing is re-tokenised. kiln's server and vLLM answer on
``/v1/completions`` (a token-id ``prompt``); SGLang on its native ``/generate`` (``input_ids``), the route its
``output_ids`` and ``output_token_logprobs`` come back on. The weight-update contract maps onto each engine's own
routes: ``KilnEndpoint`` (``kiln rl serve``), ``SGLangEndpoint``, ``VLLMEndpoint``. The request and response shapes
of the last two are checked against the engines' own wheels (tests/workers/inference/test_adapters.py,
tests/workers/rollout/test_engine_kinds.py).

Versions: both engines label the weights they load (SGLang's ``weight_version``, vLLM's ``/finish_weight_update``
``weight_version``; kiln's adapters send the trainer's version as that label) and report, per choice, the spans of
output tokens each label sampled. A label that is not a number is the weights the engine started with ("default"
in both): version 0. An answer without spans gets, for every token, the version this endpoint last loaded (0 in a
process that never updated weights, such as a rollout worker): the only version the sampler can vouch for.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx

from kiln.workers.inference.errors import EndpointAnswerError, WeightUpdateError, WeightUpdateRejected

if TYPE_CHECKING:  # weights.py imports torch (the rl extra): a rollout worker samples without it
    from kiln.workers.inference.weights import InitProcessGroupRequest, UpdateTimings, WeightUpdateRequest

EndpointKind = Literal["kiln", "vllm", "sglang"]


@dataclass
class Turn:
    """One sampled continuation, in the engine's own tokens: ``logprobs`` and ``versions`` per token id."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise EndpointAnswerError(f"{len(self.token_ids)} token ids, {len(self.logprobs)} log-probs, "
                                      f"{len(self.versions)} versions: one of each per token")


class InferenceEndpoint(Protocol):
    url: str
    packs: bool

    def init_process_group(self, request: InitProcessGroupRequest) -> None: ...

    def request_weight_update(self, request: WeightUpdateRequest) -> UpdateTimings | None: ...

    async def generate(self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None = None, user: str | None = None) -> list[Turn]: ...

    def health(self) -> dict[str, Any]: ...


def label_version(label: object) -> int:
    """An engine's weight-version label as kiln's version: the trainer's number kiln's adapters sent, or 0 for the
    weights the engine started with (its "default" label)."""
    text = str(label)
    return int(text) if text.isdigit() else 0


def span_versions(spans: list[dict[str, Any]] | None, count: int, fallback: int) -> list[int]:
    """Per-token versions from ``[{"version", "start", "end"}]`` spans over the output tokens (both engines' shape);
    tokens no span covers, or every token when there are none, get ``fallback``."""
    versions = [fallback] * count
    for span in spans or []:
        version = label_version(span["version"])
        for i in range(max(0, int(span["start"])), min(count, int(span["end"]))):
            versions[i] = version
    return versions


def _logprobs(values: list[Any], where: str) -> list[float]:
    if any(v is None for v in values):
        raise EndpointAnswerError(f"{where}: a sampled token has no log-prob")
    return [float(v) for v in values]


class HttpEndpoint:
    """What every engine shares: JSON posts, a health route, JSON admin calls with a bearer token."""

    packs = False
    health_path = "/health"

    def __init__(self, url: str, admin_token: str = "", admin_url: str | None = None, timeout_s: float = 120.0,
                 model: str = "") -> None:
        self.url = url.rstrip("/")
        self.admin_url = (admin_url or url).rstrip("/")
        self.model = model
        self.version = 0  # the weights this endpoint last had the engine load (see the module's note on versions)
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._timeout = timeout_s
        self._async: httpx.AsyncClient | None = None
        self._sync: httpx.Client | None = None

    def _admin(self, route: str, body: dict[str, Any] | None) -> dict[str, Any]:
        if self._sync is None:  # one per endpoint: a client per call built an SSL context each step (py-spy)
            self._sync = httpx.Client(timeout=self._timeout)
        try:
            answer = self._sync.post(f"{self.admin_url}{route}", json=body, headers=self._headers)
        except httpx.HTTPError as e:
            raise WeightUpdateError(f"{self.admin_url}{route}: {type(e).__name__}: {e}") from None
        if answer.status_code == 400:
            raise WeightUpdateRejected(f"{self.admin_url}{route}: {answer.text}")
        if answer.status_code != 200:
            raise WeightUpdateError(f"{self.admin_url}{route}: HTTP {answer.status_code}: {answer.text}")
        result: dict[str, Any] = answer.json() if answer.content else {}
        if result.get("success") is False:  # SGLang answers 200 with success: false for some refusals
            raise WeightUpdateRejected(f"{self.admin_url}{route}: {result.get('message')}")
        return result

    async def _post(self, route: str, body: dict[str, Any]) -> Any:
        if self._async is None:
            # Every request in flight keeps its connection: past httpx's default 20 kept alive, each completion
            # beyond them opened and closed a connection.
            self._async = httpx.AsyncClient(timeout=self._timeout, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None))
        answer = await self._async.post(f"{self.url}{route}", json=body)
        answer.raise_for_status()
        return answer.json()

    def completion_body(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float, top_p: float,
                        seed: int | None, user: str | None) -> dict[str, Any]:
        """OpenAI's completion request with a token-id prompt (vLLM's and kiln's) and the sampled tokens'
        log-probs (``logprobs: 0``: the sampled token's own, no alternatives). vLLM seeds one generator per
        request (its n samples differ); kiln's server gives choice i seed + i."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens,
                                "temperature": temperature, "top_p": top_p, "logprobs": 0}
        if seed is not None:
            body["seed"] = seed
        if user is not None:
            body["user"] = user
        return body

    def health(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}{self.health_path}", timeout=10)
        answer.raise_for_status()
        result: dict[str, Any] = answer.json() if answer.content else {}
        return result


_BatchKey = tuple[int, int, float, float, bool, str | None]
"""What calls sharing a request have in common: n, max_tokens, temperature, top_p, unseeded, user."""


@dataclass
class _Call:
    """One ``generate`` call waiting for its batch's answer."""

    prompt_ids: list[int]
    seed: int | None
    done: asyncio.Future[list[Turn]]


class KilnEndpoint(HttpEndpoint):
    """kiln's server (``kiln rl serve``). ``admin_url`` when the weight-update routes are on a separate (private)
    address.

    ``generate`` calls travel together: while ``max_in_flight`` requests are out, calls wait and go as one request
    when one comes back (up to ``batch_prompts`` prompts, one per call, each with its seed: the server's ``seeds``
    extension), so a lone call goes at once and a flood costs a request per batch, not per group. The server
    samples each as if it had come alone."""

    packs = True
    health_path = "/healthz"

    def __init__(self, url: str, admin_token: str = "", admin_url: str | None = None, timeout_s: float = 120.0,
                 model: str = "kiln-tiny", max_in_flight: int = 2, batch_prompts: int = 64) -> None:
        super().__init__(url, admin_token, admin_url, timeout_s, model)
        self.max_in_flight = max_in_flight
        self.batch_prompts = batch_prompts
        self._waiting: dict[_BatchKey, list[_Call]] = {}
        self._in_flight = 0
        self._requests: set[asyncio.Task[None]] = set()

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        self._admin("/init_process_group", request.model_dump())

    def request_weight_update(self, request: WeightUpdateRequest) -> UpdateTimings:
        from kiln.workers.inference.weights import UpdateTimings  # a trainer's call: it has the rl extra

        timings = UpdateTimings.model_validate(self._admin("/request_weight_update", request.model_dump()))
        self.version = request.version
        return timings

    async def generate(self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None = None, user: str | None = None) -> list[Turn]:
        """kiln's server: its ``kiln`` extension carries each choice's token ids and per-token versions. Calls with
        the same sampling settings and ``user`` share a request (see the class; OpenAI's ``user`` is one per
        request); a request of one call is OpenAI's own shape (one prompt, ``seed``, ``user``)."""
        call = _Call(prompt_ids, seed, asyncio.get_running_loop().create_future())
        self._waiting.setdefault((n, max_tokens, temperature, top_p, seed is None, user), []).append(call)
        self._send()
        return await call.done

    def _send(self) -> None:
        while self._in_flight < self.max_in_flight and self._waiting:
            key, calls = next(iter(self._waiting.items()))
            del self._waiting[key]
            calls = [c for c in calls if not c.done.done()]  # a caller cancelled while its call waited
            if len(calls) > self.batch_prompts:
                self._waiting[key] = calls[self.batch_prompts:]
            if not calls[:self.batch_prompts]:
                continue
            self._in_flight += 1
            request = asyncio.ensure_future(self._answer(key, calls[:self.batch_prompts]))
            self._requests.add(request)
            request.add_done_callback(self._requests.discard)

    async def _answer(self, key: _BatchKey, calls: list[_Call]) -> None:
        answers: list[list[Turn] | BaseException]
        try:
            answers = list(await self._request(key, calls))
        except httpx.HTTPStatusError as e:
            if e.response.status_code in (400, 422) and len(calls) > 1:
                # a prompt refused (too long, ids out of range) fails only its own call: each again alone
                alone = await asyncio.gather(*(self._request(key, [c]) for c in calls), return_exceptions=True)
                answers = [a[0] if isinstance(a, list) else a for a in alone]
            else:
                answers = [e] * len(calls)
        except asyncio.CancelledError:
            for call in calls:
                call.done.cancel()
            raise
        except Exception as e:
            answers = [e] * len(calls)
        finally:
            self._in_flight -= 1
            self._send()
        for call, answer in zip(calls, answers, strict=True):
            if call.done.done():  # its caller was cancelled
                continue
            if isinstance(answer, BaseException):
                call.done.set_exception(answer)
            else:
                call.done.set_result(answer)

    async def _request(self, key: _BatchKey, calls: list[_Call]) -> list[list[Turn]]:
        n, max_tokens, temperature, top_p, unseeded, user = key
        body: dict[str, Any] = {"model": self.model, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                                "top_p": top_p, "logprobs": 0}
        if len(calls) == 1:
            body["prompt"] = calls[0].prompt_ids
            if not unseeded:
                body["seed"] = calls[0].seed
        else:
            body["prompt"] = [c.prompt_ids for c in calls]
            if not unseeded:
                body["seeds"] = [c.seed for c in calls]
        if user is not None:
            body["user"] = user
        answer = await self._post("/v1/completions", body)
        where = f"{self.url}/v1/completions"
        choices = answer["choices"]
        if len(choices) != n * len(calls):
            raise EndpointAnswerError(f"{where}: {len(choices)} choices for {len(calls)} prompts of {n}")
        turns = []
        for choice in choices:
            kiln = choice.get("kiln") or {}
            if "token_ids" not in kiln or not choice.get("logprobs"):
                raise EndpointAnswerError(f"{where}: no kiln.token_ids or logprobs (is it kiln's server?)")
            ids = list(kiln["token_ids"])
            turns.append(Turn(choice["text"], ids, _logprobs(choice["logprobs"]["token_logprobs"], where),
                              list(kiln.get("token_versions") or [self.version] * len(ids)),
                              choice["finish_reason"]))
        return [turns[j * n:(j + 1) * n] for j in range(len(calls))]


class SGLangEndpoint(HttpEndpoint):
    """SGLang's distributed weight update (checked against sglang 0.5.23's ``io_struct``): the group joins through
    ``/init_weights_update_group``, each update is one ``/update_weights_from_distributed`` that blocks while the
    trainer broadcasts in the announced order. SGLang builds its group with torch's rendezvous (``tcp://`` on the
    trainer's store, prefix ``<group_name>/``) — the layout ``WeightBroadcaster`` uses."""

    @staticmethod
    def init_body(request: InitProcessGroupRequest) -> dict[str, Any]:
        return {"master_address": request.master_address, "master_port": request.master_port,
                "rank_offset": request.rank, "world_size": request.world_size, "group_name": request.group_name,
                "backend": request.backend}

    def __init__(self, url: str, admin_token: str = "", admin_url: str | None = None, timeout_s: float = 300.0,
                 model: str = "", group_name: str = "weight_update_group") -> None:
        super().__init__(url, admin_token, admin_url, timeout_s, model)
        self._group_name = group_name

    def update_body(self, request: WeightUpdateRequest) -> dict[str, Any]:
        infos = request.parameters_info
        return {"names": [i.name for i in infos], "dtypes": [i.dtype for i in infos],
                "shapes": [i.shape for i in infos], "group_name": self._group_name,
                "weight_version": str(request.version)}

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        self._group_name = request.group_name
        self._admin("/init_weights_update_group", self.init_body(request))

    def request_weight_update(self, request: WeightUpdateRequest) -> None:
        self._admin("/update_weights_from_distributed", self.update_body(request))
        self.version = request.version

    @staticmethod
    def generate_body(prompt_ids: list[int], n: int, max_tokens: int, temperature: float, top_p: float,
                      seed: int | None) -> dict[str, Any]:
        """SGLang's native ``/generate`` (``GenerateReqInput``; its sampling params are ``api/v1``'s
        ``SamplingParams``, which refuses unknown keys): ``return_logprob`` gives ``output_token_logprobs`` for the
        output tokens only (``logprob_start_len`` defaults to -1)."""
        params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        if seed is None:
            return {"input_ids": prompt_ids, "sampling_params": {**params, "n": n}, "return_logprob": True}
        # SGLang gives each of n parallel samples the one sampling_seed (n equal samples): seeded, the group is a
        # batch of the prompt n times, sample i with seed + i (as kiln's server does)
        return {"input_ids": [prompt_ids] * n, "sampling_params": [{**params, "sampling_seed": seed + i}
                                                                   for i in range(n)], "return_logprob": True}

    async def generate(self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None = None, user: str | None = None) -> list[Turn]:
        """One dict for a single unseeded sample, a list of n otherwise (SGLang answers a batch, and parallel
        samples are one, with a list); per output:
        ``output_ids`` (through the stop token), ``meta_info.output_token_logprobs`` as ``[logprob, id, text]``,
        ``meta_info.finish_reason`` as ``{"type": ...}``, ``meta_info.weight_versions`` spans. ``user`` has no
        SGLang field."""
        answer = await self._post("/generate", self.generate_body(prompt_ids, n, max_tokens, temperature, top_p,
                                                                  seed))
        outputs = answer if isinstance(answer, list) else [answer]
        return [self._turn(out) for out in outputs]

    def _turn(self, out: dict[str, Any]) -> Turn:
        where, meta = f"{self.url}/generate", out.get("meta_info") or {}
        ids, scored = out.get("output_ids"), meta.get("output_token_logprobs")
        if ids is None or scored is None:
            raise EndpointAnswerError(f"{where}: no output_ids or meta_info.output_token_logprobs")
        if [int(s[1]) for s in scored] != list(ids):
            raise EndpointAnswerError(f"{where}: output_token_logprobs are not output_ids' ({len(scored)} vs "
                                      f"{len(ids)} tokens)")
        reason = meta.get("finish_reason") or {}
        if reason.get("type") not in ("stop", "length"):
            raise EndpointAnswerError(f"{where}: finished with {reason}")
        fallback = label_version(meta["weight_version"]) if "weight_version" in meta else self.version
        return Turn(out.get("text") or "", list(ids), _logprobs([s[0] for s in scored], where),
                    span_versions(meta.get("weight_versions"), len(ids), fallback), str(reason["type"]))


class VLLMEndpoint(HttpEndpoint):
    """vLLM's native weight transfer (checked against vllm 0.33.0: ``vllm/entrypoints/rl/online/api_router.py``,
    server started with ``--weight-transfer-config '{"backend": "nccl"}'``): ``/init_weight_transfer_engine`` once,
    then per update ``/start_weight_update``, ``/update_weights`` (blocks while the trainer broadcasts) and
    ``/finish_weight_update`` with the version. vLLM's transfer is NCCL only, and its workers rendezvous through
    vLLM's ``StatelessProcessGroup`` (or an NCCL unique id): the trainer's side of that needs a GPU and is not part of
    ``WeightBroadcaster`` — this adapter carries the control plane."""

    @staticmethod
    def init_body(request: InitProcessGroupRequest) -> dict[str, Any]:
        if request.backend != "nccl":
            raise WeightUpdateRejected("vLLM's weight transfer is NCCL only")
        return {"init_info": {"master_address": request.master_address, "master_port": request.master_port,
                              "rank_offset": request.rank, "world_size": request.world_size}}

    @staticmethod
    def update_calls(request: WeightUpdateRequest) -> list[tuple[str, dict[str, Any] | None]]:
        infos = request.parameters_info
        update = {"names": [i.name for i in infos], "dtype_names": [i.dtype for i in infos],
                  "shapes": [i.shape for i in infos]}
        return [("/start_weight_update", None), ("/update_weights", {"update_info": update}),
                ("/finish_weight_update", {"weight_version": str(request.version)})]

    def init_process_group(self, request: InitProcessGroupRequest) -> None:
        self._admin("/init_weight_transfer_engine", self.init_body(request))

    def request_weight_update(self, request: WeightUpdateRequest) -> None:
        for route, body in self.update_calls(request):
            self._admin(route, body)
        self.version = request.version

    def completion_body(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float, top_p: float,
                        seed: int | None, user: str | None) -> dict[str, Any]:
        """vLLM's extensions (``CompletionRequest``): ``return_token_ids`` for each choice's ``token_ids`` (and
        ``prompt_token_ids``), ``return_weight_versions`` for its ``weight_versions`` spans. vLLM's log-probs are
        the model's raw ones unless the server runs with ``--logprobs-mode processed_logprobs`` (those of the
        distribution sampled, after temperature — what an importance ratio needs)."""
        return {**super().completion_body(prompt_ids, n, max_tokens, temperature, top_p, seed, user),
                "return_token_ids": True, "return_weight_versions": True}

    async def generate(self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None = None, user: str | None = None) -> list[Turn]:
        answer = await self._post("/v1/completions",
                                  self.completion_body(prompt_ids, n, max_tokens, temperature, top_p, seed, user))
        where, turns = f"{self.url}/v1/completions", []
        for choice in answer["choices"]:
            ids, logprobs = choice.get("token_ids"), choice.get("logprobs")
            if ids is None or not logprobs:
                raise EndpointAnswerError(f"{where}: no token_ids or logprobs (vLLM before return_token_ids?)")
            if choice.get("prompt_token_ids") not in (None, prompt_ids):
                raise EndpointAnswerError(f"{where}: the engine sampled after another prompt than the ids sent "
                                          "(truncated?)")
            if choice.get("finish_reason") not in ("stop", "length"):
                raise EndpointAnswerError(f"{where}: finished with {choice.get('finish_reason')}")
            turns.append(Turn(choice["text"], list(ids), _logprobs(logprobs["token_logprobs"], where),
                              span_versions(choice.get("weight_versions"), len(ids), self.version),
                              choice["finish_reason"]))
        return turns


def endpoint_for(kind: EndpointKind, url: str, **options: Any) -> InferenceEndpoint:
    """The endpoint class for what serves ``url`` (``RolloutSettings.endpoint_kind``); ``options`` go to its
    constructor (admin_token, admin_url, timeout_s, model)."""
    if kind == "vllm":
        return VLLMEndpoint(url, **options)
    if kind == "sglang":
        return SGLangEndpoint(url, **options)
    return KilnEndpoint(url, **options)
