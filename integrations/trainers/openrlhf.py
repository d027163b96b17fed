"""OpenRLHF's remote reward protocol (``--remote_rm_url http://GATEWAY:8500/openrlhf/reward``), as its
``SingleTurnAgentExecutor`` speaks it (openrlhf 0.11): ``POST {"query": [...], "prompts": [...], "labels": [...]}``
→ ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. ``query`` is the decoded prompt and response;
``labels`` the dataset's ``--label_key`` column: a kiln task (JSON) or a plain answer (``task_of``). OpenRLHF logs
``extra_logs`` as numbers: ``kiln_failed`` (1 for no real verdict) and ``kiln_version_id`` (the verifier version's
first 24 bits, ``version_id``: a change in it is a change of verifier); the gateway's own log names each version
(``note_versions``).

"No reward" in OpenRLHF 0.11.2: none per sample. Its executor sends each sample alone, one request per sample, a
prompt's ``n_samples_per_prompt`` at once (``utils/agent.py:292``, ``trainer/ray/vllm_engine.py:195``); a reward it
cannot read leaves the sample without one, and the step fails (``trainer/ppo_utils/experience_maker.py:139``); the
only drop is of a whole prompt, with ``--algo.dynamic_filtering_enable``, whose range test a NaN fails
(``trainer/ppo_utils/samples_generator.py:173``), and without that flag a NaN poisons the group's advantage
(``trainer/ppo_utils/experience_maker.py:268`` to ``:275``: the group's mean and std). So the gateway gives a
completion kiln could not judge (retried first within ``KILN_VERIFY_RETRY_*``) its group's mean of real verdicts
(``GroupBaseline``; the group: the requests with the same prompt and label; its size
``KILN_GATEWAY_OPENRLHF_GROUP_SIZE``, OpenRLHF's ``--n_samples_per_prompt``): advantage 0 under ``group_norm``,
``dr_grpo``, ``reinforce_baseline``, and the group's baseline unchanged. (Under ``rloo`` its own advantage is 0 too;
under ``reinforce_plus_plus``, which takes no group baseline, it is a sample at the group's mean.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from pydantic import BaseModel, Field

from kiln.integrations.trainers import note_versions, task_of, version_id
from kiln.integrations.trainers.groups import GroupBaseline
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


def group_key(prompt: str, label: Any) -> str:
    """The group a sample belongs to: the samples of one prompt share its text and label."""
    return hashlib.sha256(json.dumps([prompt, label], sort_keys=True, default=str).encode()).hexdigest()


async def rewards(client: VerifyClient, request: RewardRequest, groups: GroupBaseline) -> RewardResponse:
    n = len(request.query)
    prompts = request.prompts or [""] * n
    labels = request.labels or [None] * n
    if len(prompts) != n or len(labels) != n:
        raise ValueError(f"{n} queries, {len(prompts)} prompts, {len(labels)} labels")
    tasks = [task_of(label, prompt) for label, prompt in zip(labels, prompts, strict=True)]
    verdicts = await client.verify_batch(tasks, [completion_of(q, p) for q, p in zip(request.query, prompts,
                                                                                      strict=True)])
    note_versions(verdicts)
    scores = list(await asyncio.gather(*(groups.reward(group_key(p, lab), v)
                                         for p, lab, v in zip(prompts, labels, verdicts, strict=True))))
    return RewardResponse(rewards=scores, scores=scores,
                          extra_logs={"kiln_failed": [1.0 if v.failure else 0.0 for v in verdicts],
                                      "kiln_version_id": [version_id(v.version) for v in verdicts]})
