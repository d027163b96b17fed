"""AReaL: kiln verdicts as AReaL rewards.

"No reward" in AReaL 1.0.4 is a rejected group. A group is ``GroupedRolloutWorkflow`` (what a ``group_size`` > 1
wraps a workflow in, ``infra/remote_inf_engine.py:71``): its episodes gathered together (``:89``). An exception from
one fails the gather, and the executor rejects the whole group (``infra/workflow_executor.py:1143``), as it rejects
one whose every episode returned ``None`` (``:1092``, "returned_none"). Returning ``None`` from a single episode
would not do: the group keeps its other episodes (``infra/remote_inf_engine.py:93`` to ``:104``), and AReaL's group
normalisation slices the batch into fixed ``group_size`` rows (``utils/data.py:1424``), so a short group shifts every
group after it. A reward function has no "no reward" of its own: it returns a float, and AReaL's
``AsyncRewardWrapper`` turns one that takes longer than its ``timeout_seconds`` (15 s) into 0 after its retries
(``api/reward_api.py:154`` to ``:161``): a fake zero for any check slower than that, kiln's retries included.

- ``KilnRLVRWorkflow`` (``kiln.integrations.trainers.areal_workflow``; imports AReaL): AReaL's ``RLVRWorkflow`` with
  kiln's verdict awaited directly (no process pool, no 15 s timeout); an episode kiln could not judge raises
  ``NoReward``, so AReaL rejects its group. The way to train with kiln in AReaL.
- ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)`` — AReaL's reward signature (its
  ``RLVRWorkflow(reward_fn=...)`` or ``"kiln.integrations.trainers.areal.reward_fn"``; run in AReaL's process pool, so a
  plain module-level function, each pool process keeping its own kiln client) and ``async_reward_fn``, the same
  awaitable: a completion kiln could not judge raises ``NoReward`` too (the group is rejected, never scored 0), but
  under ``RLVRWorkflow`` a check longer than the wrapper's 15 s still becomes AReaL's 0.

The task is the row's ``kiln_task`` column, else its ``answer`` or ``solution`` (``task_of``). AReaL takes a float:
the verifier version goes to the ``kiln.rewards`` log the first time a process sees it (``note_versions``).
"""

from __future__ import annotations

from typing import Any

from kiln.integrations.trainers import note_versions, shared_client, task_of
from kiln.integrations.trainers.errors import NoReward
from kiln.schemas.verify import CompletionVerdict


def task_label(prompt: str, data: dict[str, Any]) -> Any:
    label = data.get("kiln_task")
    if label is None:
        label = data.get("answer", data.get("solution"))
    return task_of(label, prompt)


def judged(verdict: CompletionVerdict) -> float:
    """The verdict's reward; ``NoReward`` when kiln could not judge the completion."""
    note_versions([verdict])
    if verdict.failure:
        raise NoReward(verdict)
    return verdict.reward


def reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
              **data: Any) -> float:
    del prompt_ids, completion_ids
    return judged(shared_client().verify(task_label(prompt, data), [completions])[0])


async def async_reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
                          **data: Any) -> float:
    del prompt_ids, completion_ids
    client = shared_client()
    return judged((await client.submit(client.client.verify(task_label(prompt, data), [completions])))[0])
