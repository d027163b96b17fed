"""verl: kiln verdicts as verl reward functions. verl loads a reward function from a file path
(``reward.custom_reward_function.path``/``name``):

- ``compute_score(data_source, solution_str, ground_truth, extra_info)`` — one completion (verl's reward loop
  awaits it, many at once; an async function, so no thread waits on kiln);
- ``compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos)`` — the ``batch`` reward manager's
  call: the whole step's batch at once, one verify request per distinct task.

The task is ``extra_info["kiln_task"]`` when the row has one, else ``ground_truth`` (see ``task_of``). Each returns
``{"score": reward, "kiln_failure": "" | failure, "kiln_verifier": name, "kiln_version": version}``: verl takes
``score`` as the reward and keeps the other keys per sample in its ``reward_extra_info`` (dumped with the step's
generations), so a run's samples name the verifier version that scored them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.integrations.trainers import shared_client, task_of
from kiln.schemas.verify import CompletionVerdict


def _task_label(ground_truth: Any, extra_info: Any) -> Any:
    if isinstance(extra_info, dict) and extra_info.get("kiln_task") is not None:
        return extra_info["kiln_task"]
    return ground_truth


def _score(verdict: CompletionVerdict) -> dict[str, Any]:
    return {"score": verdict.reward, "kiln_failure": verdict.failure or "", "kiln_verifier": verdict.verifier,
            "kiln_version": verdict.version}


async def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                        **kwargs: Any) -> dict[str, Any]:
    del data_source, kwargs
    client = shared_client()
    task = task_of(_task_label(ground_truth, extra_info))
    verdicts = await client.submit(client.client.verify(task, [solution_str]))
    return _score(verdicts[0])


def compute_score_batch(data_sources: Sequence[Any], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                        extra_infos: Sequence[Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    del data_sources, kwargs
    extras = list(extra_infos) if extra_infos is not None else [None] * len(solution_strs)
    tasks = [task_of(_task_label(g, e)) for g, e in zip(ground_truths, extras, strict=True)]
    return [_score(v) for v in shared_client().verify_batch(tasks, list(solution_strs))]
