"""``rollout``: per prompt group, n samples from an inference server and a reward for each from the task's verifier
(``verifiers.py``: in process, or kiln's exec and Lean stages through their client facades); the group goes to the
requester and to ``rollouts`` (committed only after both are written — the runtime's rule). A group trains whole, so
a sample kiln could not judge (its sandbox, checker or a stage failed it) is never sent with a 0: the group is an
error instead (``unjudged``), retried when the failure is transient, answered as an error when it is routine. A
sample that failed by itself (past its time, crashed, wrong) is a real 0 and the group goes out.

Settings ``KILN_ROLLOUT_*``: the servers to sample from (round-robin) and what they are (``endpoint_kind``: kiln's
``kiln rl serve``, vLLM or SGLang), the policy's ``model`` (whose tokenizer this worker loads), the verifiers'
session pool. Token in, token out: a task's prompt is tokenised once here (the model's chat template when ``chat``)
and sent as ids; each engine's answer is read from its own fields into token ids, log-probs and per-token versions
(``kiln.workers.inference.endpoints``); the group carries the prompt ids and each sample's completion ids, which
are what the trainer trains on.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.rl import RolloutGroup, RolloutRequest, RolloutSample
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed, RoutineJobError, TransientJobError
from kiln.streams.settings import get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.exec.client import ExecClient
from kiln.workers.inference.endpoints import InferenceEndpoint, endpoint_for
from kiln.workers.inference.errors import EndpointAnswerError
from kiln.workers.inference.tokenizer import PolicyTokenizer, load_tokenizer, tokenize_prompt
from kiln.workers.rollout import spec
from kiln.workers.rollout.episodes import Episode, run_episode
from kiln.workers.verifiers import VerifierContext, Verifiers, unjudged


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_ROLLOUT_", extra="ignore")

    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8400"],
                                 description="Inference servers (JSON list), used round-robin.")
    endpoint_kind: Literal["kiln", "vllm", "sglang"] = Field("kiln", description="What serves them: kiln's server "
                                                                              "(``kiln rl serve``), vLLM or SGLang.")
    model: str = Field("char", description="The policy: 'char' (kiln's character model) or a Hugging Face model's "
                                           "directory; prompts and tool output are tokenised with its tokenizer.")
    chat: bool = Field(True, description="Send each task's prompt as one user message through the model's chat "
                                         "template (with the generation prompt); false: the prompt text as is. "
                                         "The character model has no template (same ids either way).")
    served_model: str = Field("", description="OpenAI's ``model`` field in completion requests: the name the "
                                              "server serves the policy under (vLLM checks it; empty: its default).")
    timeout_s: float = Field(600.0, gt=0, description="Per completion request.")
    exec_calls: int = Field(8, ge=1, description="Exec run_once calls a worker's verifiers keep in flight.")
    exec_batch_groups: int = Field(32, ge=1, description="Groups one exec command may verify together.")
    exec_batch_window_s: float = Field(0.02, ge=0, description="The longest a command's batch gathers groups while "
                                                                "they keep coming (a lone group goes at once).")
    exec_batch_quiet_s: float = Field(0.005, ge=0, description="A gathering batch goes once no group has joined it "
                                                                "for this long.")


registry = CollectorRegistry()
GROUPS = Counter("kiln_rollout_groups_total", "Prompt groups sampled and verified.", registry=registry)
REWARD = Histogram("kiln_rollout_reward", "Reward per sample.", buckets=(0.0, 0.25, 0.5, 0.75, 1.0),
                   registry=registry)
GENERATE = Histogram("kiln_rollout_generate_seconds", "Time to sample one group.", registry=registry)
VERIFY = Histogram("kiln_rollout_verify_seconds", "Time to verify one group.", ["verifier"], registry=registry)

_endpoints: list[InferenceEndpoint] = []
_turn = itertools.count()
_verifiers: list[Verifiers] = []
_tokenizer: list[PolicyTokenizer] = []
_chat: list[bool] = []


async def setup(slots: int) -> None:
    settings = RolloutSettings()
    options = {"timeout_s": settings.timeout_s, **({"model": settings.served_model} if settings.served_model else {})}
    _endpoints[:] = [endpoint_for(settings.endpoint_kind, url, **options) for url in settings.endpoints]
    _tokenizer[:], _chat[:] = [load_tokenizer(settings.model)], [settings.chat]
    # Its own client id: results of its exec/Lean requests come back to this process only. The deployment's blob
    # store: a result above KILN_CLAIM_CHECK_BYTES (a checker's or a program's output) comes back as a claim check.
    blobs = await asyncio.to_thread(open_blob_store, get_settings())
    kiln = KilnClient(get_settings(), f"rollout.{socket.gethostname()}.{os.getpid()}", blob_store=blobs)
    _verifiers[:] = [Verifiers(VerifierContext(kiln, exec_calls=settings.exec_calls,
                                               exec_batch_groups=settings.exec_batch_groups,
                                               exec_batch_window_s=settings.exec_batch_window_s,
                                               exec_batch_quiet_s=settings.exec_batch_quiet_s))]


async def teardown() -> None:
    for verifiers in _verifiers:
        await verifiers.close()


async def _episodes(endpoint: InferenceEndpoint, request: RolloutRequest, prompt_ids: list[int],
                    request_id: str) -> list[Episode]:
    s, task = request.sampling, request.task
    sampling: dict[str, Any] = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p}
    if task.max_turns == 1:
        episodes = []
        for turn in await endpoint.generate(prompt_ids, n=s.n, seed=s.seed, **sampling):
            episodes.append(Episode())
            episodes[-1].policy(turn)
        return episodes
    image = str(task.check.get("image", ""))
    if not image:
        raise RoutineJobError(f"task {task.task_id}: tool calls need check['image'] (the sessions' image)")
    tools = ExecClient(_verifiers[0].context.kiln)
    # sample i of a seeded group draws every turn with seed + i: one request per turn, each its own sample
    return list(await asyncio.gather(*(run_episode(endpoint, tools, _tokenizer[0], image, prompt_ids, task.max_turns,
                                                   {**sampling, "seed": None if s.seed is None else s.seed + i},
                                                   f"{request_id}/{i}") for i in range(s.n))))


async def handle(request: RolloutRequest, ctx: JobContext) -> RolloutGroup:
    endpoint = _endpoints[next(_turn) % len(_endpoints)]
    prompt_ids = tokenize_prompt(_tokenizer[0], request.task.prompt, _chat[0])
    started = time.perf_counter()
    try:
        episodes = await _episodes(endpoint, request, prompt_ids, ctx.envelope.request_id)
    except EndpointAnswerError as e:
        raise RoutineJobError(str(e)) from None
    except httpx.HTTPStatusError as e:
        if e.response.status_code in (400, 422):
            raise RoutineJobError(f"{endpoint.url} refused the prompt: {e.response.text[:500]}") from None
        raise TransientJobError(f"{endpoint.url}: HTTP {e.response.status_code}") from None
    except httpx.HTTPError as e:
        raise TransientJobError(f"{endpoint.url}: {type(e).__name__}: {e}") from None
    except RequestFailed as e:
        raise TransientJobError(f"a tool call's exec session failed: {e.reason}") from None
    generated = time.perf_counter()
    verifier = _verifiers[0].get(request.task.verifier)
    verdicts = _verifiers[0].stamped(
        request.task, await verifier.verify(request.task, [e.answer for e in episodes], ctx.envelope.request_id))
    VERIFY.labels(request.task.verifier).observe(time.perf_counter() - generated)
    failed = unjudged(verdicts)
    if failed is not None:  # a sample kiln could not judge is never trained on as a 0: the group is an error
        raise failed
    samples = []
    for episode, verdict in zip(episodes, verdicts, strict=True):
        REWARD.observe(verdict.reward)
        samples.append(RolloutSample(
            text=episode.text, token_ids=episode.token_ids, logprobs=episode.logprobs, versions=episode.versions,
            finish_reason=episode.finish_reason, reward=verdict.reward, turns=episode.turns,
            tool_mask=episode.tool_mask if episode.tool_calls else [],
            verifier={"name": request.task.verifier, "version": verdict.version, **verdict.details,
                      **({"policy_failure": verdict.policy_failure} if verdict.policy_failure else {})}))
    GROUPS.inc()
    GENERATE.observe(generated - started)
    versions = [v for e in episodes for v in e.versions]
    return RolloutGroup(task_id=request.task.task_id, prompt=request.task.prompt, prompt_ids=prompt_ids,
                        samples=samples, version_start=min(versions, default=0), version_end=max(versions, default=0),
                        actor_version=request.actor_version, endpoint=endpoint.url, generate_s=generated - started,
                        verify_s=time.perf_counter() - generated)


stage = Stage(spec.rollout, handle, job_timeout_s=900, registry=registry, setup=setup,
              teardown=teardown)
