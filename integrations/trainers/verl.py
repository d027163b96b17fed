"""verl: kiln verdicts as verl rewards.

verl (0.9.1) has no per-sample "no reward": a sample's score lands in ``rm_scores`` and goes into its group's
advantage (``trainer/ppo/core_algos.py:268``, ``compute_grpo_outcome_advantage``: mean and std over every score of
a ``uid``); a NaN makes the step's loss NaN, and the engines skip that optimizer step (``workers/engine/fsdp/
transformer_impl.py:823``: a non-finite grad norm). So kiln gives a completion it could not judge (retried first
within ``KILN_VERIFY_RETRY_*``) its group's mean of real verdicts — advantage exactly 0, the group's mean unchanged
(``kiln.integrations.trainers.groups``) — through its own reward manager, which sees each sample's ``uid``:

- ``KilnRewardManager`` (``kiln.integrations.trainers.verl_manager``; verl's reward-loop manager, loaded with
  ``reward.reward_manager.source=importlib``, ``reward.reward_manager.module.path=<that file>``,
  ``reward.reward_manager.name=KilnRewardManager``, and ``reward.num_workers=1`` so that one manager sees every
  sample of a group). The way to train with kiln in verl.

Per-sample functions, for verl's own managers (``reward.custom_reward_function.path``/``name``), which pass no
``uid``: a completion kiln could not judge has no group to take a mean from and scores NaN (verl then skips that
step: no wrong gradient, a lost step), never 0:

- ``compute_score(data_source, solution_str, ground_truth, extra_info)`` — one completion (verl's reward loop
  awaits it, many at once; an async function, so no thread waits on kiln);
- ``compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos)`` — the ``batch`` reward manager's
  call: the whole step's batch at once, its groups (one per distinct task) in one verify request.

verl's own SandboxFusion scorer scores a sandbox that failed as 0 (``utils/reward_score/sandbox_fusion/__init__.py``:
``:93`` no results, ``:113`` any error reaching the sandbox): fake zeros, which kiln's gateway cannot undo behind
it; point verl at kiln's reward manager instead.

The task is ``extra_info["kiln_task"]`` when the row has one, else ``ground_truth`` (see ``task_of``). Each returns
``{"score": reward, "kiln_failure": "" | failure, "kiln_policy_failure": "" | failure, "kiln_verifier": name,
"kiln_version": version}``: verl takes ``score`` as the reward and keeps the other keys per sample in its
``reward_extra_info`` (dumped with the step's generations), so a run's samples name the verifier version that scored
them and why they failed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kiln.integrations.trainers import shared_client, task_of
from kiln.schemas.verify import CompletionVerdict


def task_label(ground_truth: Any, extra_info: Any) -> Any:
    if isinstance(extra_info, dict) and extra_info.get("kiln_task") is not None:
        return extra_info["kiln_task"]
    return ground_truth


def extra_info_of(verdict: CompletionVerdict) -> dict[str, Any]:
    """What verl keeps per sample beside its score (the same keys for every sample: verl stacks them)."""
    return {"kiln_failure": verdict.failure or "", "kiln_policy_failure": verdict.policy_failure or "",
            "kiln_verifier": verdict.verifier, "kiln_version": verdict.version}


def _score(verdict: CompletionVerdict) -> dict[str, Any]:
    return {"score": math.nan if verdict.failure else verdict.reward, **extra_info_of(verdict)}


async def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                        **kwargs: Any) -> dict[str, Any]:
    del data_source, kwargs
    client = shared_client()
    task = task_of(task_label(ground_truth, extra_info))
    verdicts = await client.submit(client.client.verify(task, [solution_str]))
    return _score(verdicts[0])


def compute_score_batch(data_sources: Sequence[Any], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                        extra_infos: Sequence[Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    del data_sources, kwargs
    extras = list(extra_infos) if extra_infos is not None else [None] * len(solution_strs)
    tasks = [task_of(task_label(g, e)) for g, e in zip(ground_truths, extras, strict=True)]
    return [_score(v) for v in shared_client().verify_batch(tasks, list(solution_strs))]
