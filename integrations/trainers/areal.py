"""AReaL: kiln verdicts as AReaL reward functions.

- ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)`` — AReaL's reward signature (its
  ``RLVRWorkflow(reward_fn=...)`` or ``"kiln.integrations.trainers.areal.reward_fn"``); AReaL's ``AsyncRewardWrapper``
  runs it in a process pool, so it is a plain module-level function (each pool process keeps its own kiln client).
- ``async_reward_fn`` — the same, awaitable, for workflows that call rewards on their own event loop.

The task is the row's ``kiln_task`` column, else its ``answer`` or ``solution`` (``task_of``); a completion without a
real verdict scores 0 (logged). AReaL takes a float: the verifier version goes to the ``kiln.rewards`` log the first
time a process sees it (``note_versions``).
"""

from __future__ import annotations

from typing import Any

from kiln.integrations.trainers import note_versions, shared_client, task_of


def _task(prompt: str, data: dict[str, Any]) -> Any:
    label = data.get("kiln_task")
    if label is None:
        label = data.get("answer", data.get("solution"))
    return task_of(label, prompt)


def reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
              **data: Any) -> float:
    del prompt_ids, completion_ids
    verdicts = shared_client().verify(_task(prompt, data), [completions])
    note_versions(verdicts)
    return verdicts[0].reward


async def async_reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
                          **data: Any) -> float:
    del prompt_ids, completion_ids
    client = shared_client()
    verdicts = await client.submit(client.client.verify(_task(prompt, data), [completions]))
    note_versions(verdicts)
    return verdicts[0].reward
