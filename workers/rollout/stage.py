"""``rollout``: per prompt group, n samples from an inference server and a reward for each from its verifier; the
group goes to the requester and to ``rollouts`` (committed only after both are written — the runtime's rule).

Settings ``KILN_ROLLOUT_*``: the servers to sample from (round-robin). Samples come from kiln's server
(``kiln rl serve``), whose choices carry the token ids and the policy version of every token.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.rl import RolloutGroup, RolloutRequest, RolloutSample
from kiln.streams.errors import RoutineJobError, TransientJobError
from kiln.streams.stage import JobContext, Stage
from kiln.workers.inference.endpoints import KilnEndpoint
from kiln.workers.rollout import spec
from kiln.workers.rollout.tasks import exact_match


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_ROLLOUT_", extra="ignore")

    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8400"],
                                 description="Inference servers (JSON list), used round-robin.")
    timeout_s: float = Field(600.0, gt=0, description="Per completion request.")


registry = CollectorRegistry()
GROUPS = Counter("kiln_rollout_groups_total", "Prompt groups sampled and verified.", registry=registry)
REWARD = Histogram("kiln_rollout_reward", "Reward per sample.", buckets=(0.0, 0.25, 0.5, 0.75, 1.0),
                   registry=registry)
GENERATE = Histogram("kiln_rollout_generate_seconds", "Time to sample one group.", registry=registry)

_endpoints: list[KilnEndpoint] = []
_turn = itertools.count()


async def setup(slots: int) -> None:
    del slots
    settings = RolloutSettings()
    _endpoints[:] = [KilnEndpoint(url, timeout_s=settings.timeout_s) for url in settings.endpoints]


def _samples(answer: dict[str, Any]) -> list[tuple[str, list[int], list[float], list[int], str]]:
    out = []
    for choice in answer["choices"]:
        kiln = choice["kiln"]
        out.append((choice["text"], kiln["token_ids"], choice["logprobs"]["token_logprobs"], kiln["token_versions"],
                    choice["finish_reason"]))
    return out


async def handle(request: RolloutRequest, ctx: JobContext) -> RolloutGroup:
    del ctx
    endpoint = _endpoints[next(_turn) % len(_endpoints)]
    s = request.sampling
    started = time.perf_counter()
    try:
        answer = await endpoint.complete(request.task.prompt, n=s.n, max_tokens=s.max_tokens,
                                         temperature=s.temperature, top_p=s.top_p, logprobs=0)
    except httpx.HTTPStatusError as e:
        if e.response.status_code in (400, 422):
            raise RoutineJobError(f"{endpoint.url} refused the prompt: {e.response.text[:500]}") from None
        raise TransientJobError(f"{endpoint.url}: HTTP {e.response.status_code}") from None
    except httpx.HTTPError as e:
        raise TransientJobError(f"{endpoint.url}: {type(e).__name__}: {e}") from None
    generated = time.perf_counter()
    samples = []
    for text, token_ids, logprobs, versions, finish in _samples(answer):
        reward = exact_match(request.task, text)
        REWARD.observe(reward)
        samples.append(RolloutSample(text=text, token_ids=token_ids, logprobs=logprobs, versions=versions,
                                     finish_reason=finish, reward=reward))
    GROUPS.inc()
    GENERATE.observe(generated - started)
    return RolloutGroup(task_id=request.task.task_id, prompt=request.task.prompt, samples=samples,
                        version_start=answer["kiln"]["version_start"], version_end=answer["kiln"]["version_end"],
                        actor_version=request.actor_version, endpoint=endpoint.url, generate_s=generated - started,
                        verify_s=time.perf_counter() - generated)


stage = Stage(spec.rollout, handle, job_timeout_s=900, registry=registry, setup=setup)
