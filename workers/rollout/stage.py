"""``rollout``: per prompt group, n samples from an inference server and a reward for each from the task's verifier
(``verifiers.py``: in process, or kiln's exec and Lean stages through their client facades); the group goes to the
requester and to ``rollouts`` (committed only after both are written — the runtime's rule).

Settings ``KILN_ROLLOUT_*``: the servers to sample from (round-robin), the verifiers' session pool. Samples come from
kiln's server (``kiln rl serve``), whose choices carry the token ids and the policy version of every token.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.rl import RolloutGroup, RolloutRequest, RolloutSample
from kiln.streams.client import KilnClient
from kiln.streams.errors import RoutineJobError, TransientJobError
from kiln.streams.settings import get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.inference.endpoints import KilnEndpoint
from kiln.workers.rollout import spec
from kiln.workers.rollout.verifiers import VerifierContext, Verifiers


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_ROLLOUT_", extra="ignore")

    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8400"],
                                 description="Inference servers (JSON list), used round-robin.")
    timeout_s: float = Field(600.0, gt=0, description="Per completion request.")
    exec_sessions: int = Field(4, ge=1, description="Exec sessions per image a worker keeps for verifying.")
    exec_session_groups: int = Field(16, ge=1, description="Commands an exec session runs before it is replaced.")
    exec_batch_groups: int = Field(16, ge=1, description="Groups one exec command may verify together.")
    exec_batch_window_s: float = Field(0.02, ge=0, description="How long a group waits for others to share its "
                                                                "command.")


registry = CollectorRegistry()
GROUPS = Counter("kiln_rollout_groups_total", "Prompt groups sampled and verified.", registry=registry)
REWARD = Histogram("kiln_rollout_reward", "Reward per sample.", buckets=(0.0, 0.25, 0.5, 0.75, 1.0),
                   registry=registry)
GENERATE = Histogram("kiln_rollout_generate_seconds", "Time to sample one group.", registry=registry)
VERIFY = Histogram("kiln_rollout_verify_seconds", "Time to verify one group.", ["verifier"], registry=registry)

_endpoints: list[KilnEndpoint] = []
_turn = itertools.count()
_verifiers: list[Verifiers] = []


async def setup(slots: int) -> None:
    settings = RolloutSettings()
    _endpoints[:] = [KilnEndpoint(url, timeout_s=settings.timeout_s) for url in settings.endpoints]
    # Its own client id: results of its exec/Lean requests come back to this process only.
    kiln = KilnClient(get_settings(), f"rollout.{socket.gethostname()}.{os.getpid()}")
    _verifiers[:] = [Verifiers(VerifierContext(kiln, exec_session_groups=settings.exec_session_groups,
                                               exec_sessions=min(settings.exec_sessions, slots),
                                               exec_batch_groups=settings.exec_batch_groups,
                                               exec_batch_window_s=settings.exec_batch_window_s))]


async def teardown() -> None:
    for verifiers in _verifiers:
        await verifiers.close()


def _samples(answer: dict[str, Any]) -> list[tuple[str, list[int], list[float], list[int], str]]:
    out = []
    for choice in answer["choices"]:
        kiln = choice["kiln"]
        out.append((choice["text"], kiln["token_ids"], choice["logprobs"]["token_logprobs"], kiln["token_versions"],
                    choice["finish_reason"]))
    return out


async def handle(request: RolloutRequest, ctx: JobContext) -> RolloutGroup:
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
    drawn = _samples(answer)
    verifier = _verifiers[0].get(request.task.verifier)
    verdicts = await verifier.verify(request.task, [text for text, *_ in drawn], ctx.envelope.request_id)
    VERIFY.labels(request.task.verifier).observe(time.perf_counter() - generated)
    samples = []
    for (text, token_ids, logprobs, versions, finish), verdict in zip(drawn, verdicts, strict=True):
        REWARD.observe(verdict.reward)
        samples.append(RolloutSample(text=text, token_ids=token_ids, logprobs=logprobs, versions=versions,
                                     finish_reason=finish, reward=verdict.reward,
                                     verifier={"name": request.task.verifier, **verdict.detail}))
    GROUPS.inc()
    GENERATE.observe(generated - started)
    return RolloutGroup(task_id=request.task.task_id, prompt=request.task.prompt, samples=samples,
                        version_start=answer["kiln"]["version_start"], version_end=answer["kiln"]["version_end"],
                        actor_version=request.actor_version, endpoint=endpoint.url, generate_s=generated - started,
                        verify_s=time.perf_counter() - generated)


stage = Stage(spec.rollout, handle, job_timeout_s=900, registry=registry, setup=setup,
              teardown=teardown)
