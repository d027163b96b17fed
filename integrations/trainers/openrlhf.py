"""OpenRLHF's remote reward protocol (``--remote_rm_url http://GATEWAY:8500/openrlhf/reward``), as its
``SingleTurnAgentExecutor`` speaks it (openrlhf 0.11): ``POST {"query": [...], "prompts": [...], "labels": [...]}``
→ ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. ``query`` is the decoded prompt and response;
``labels`` the dataset's ``--label_key`` column: a kiln task (JSON) or a plain answer (``task_of``). OpenRLHF logs
``extra_logs`` as numbers: ``kiln_failed`` (1 for no real verdict) and ``kiln_version_id`` (the verifier version's
first 24 bits, ``version_id``: a change in it is a change of verifier); the gateway's own log names each version
(``note_versions``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from kiln.integrations.trainers import note_versions, task_of, version_id
from kiln.workers.verify.client import VerifyClient


class RewardRequest(BaseModel):
    query: list[str] = Field(max_length=4096)
    prompts: list[str] = Field(default_factory=list)
    labels: list[Any] = Field(default_factory=list)


class RewardResponse(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[Any]]


def completion_of(query: str, prompt: str) -> str:
    """The response: the query after its prompt (OpenRLHF sends prompt and response decoded together)."""
    return query[len(prompt):] if prompt and query.startswith(prompt) else query


async def rewards(client: VerifyClient, request: RewardRequest) -> RewardResponse:
    n = len(request.query)
    prompts = request.prompts or [""] * n
    labels = request.labels or [None] * n
    if len(prompts) != n or len(labels) != n:
        raise ValueError(f"{n} queries, {len(prompts)} prompts, {len(labels)} labels")
    tasks = [task_of(label, prompt) for label, prompt in zip(labels, prompts, strict=True)]
    verdicts = await client.verify_batch(tasks, [completion_of(q, p) for q, p in zip(request.query, prompts,
                                                                                      strict=True)])
    note_versions(verdicts)
    scores = [v.reward for v in verdicts]
    return RewardResponse(rewards=scores, scores=scores,
                          extra_logs={"kiln_failed": [1.0 if v.failure else 0.0 for v in verdicts],
                                      "kiln_version_id": [version_id(v.version) for v in verdicts]})
