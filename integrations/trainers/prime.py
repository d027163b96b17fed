"""prime-rl / ``verifiers`` (0.4, ``verifiers.v1``): ``KilnTask``, a task whose reward is kiln's verdict on the
trace's last reply. Its data carries the kiln task (``kiln_task``: the ``RolloutTask`` fields) beside the prompt;
an environment's taskset yields ``KilnTask(KilnTaskData(prompt=..., kiln_task={...}))``. Needs ``verifiers``
installed (not a kiln dependency). The reward is a float: the verifier version goes to the ``kiln.rewards`` log the
first time a process sees it (``note_versions``).

"No reward" in ``verifiers`` 0.4 is an errored trace: a reward that raises ``vf.SandboxError`` ("a runtime/sandbox
operation failed", ``v1/errors.py:64``) passes the scoring boundary as itself (``v1/errors.py:81``, ``boundary``:
an already-typed ``RolloutError`` is not re-wrapped), the rollout records it (``v1/rollout.py:622``: ``fail``) and
the trace is not ``ok`` (``v1/rollout.py:630``), its stop condition ``sandbox_error`` (``v1/errors.py:98``); a
group's means are taken over the traces without an error (``v1/utils/format.py:66``). prime-rl trains on traces
without errors (its orchestrator; prime-rl is not on PyPI, so that step is not exercised here). So a completion kiln
could not judge (retried first within ``KILN_VERIFY_RETRY_*``) raises ``vf.SandboxError``; one that failed by itself
scores 0."""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf

from kiln.integrations.trainers import note_versions, shared_client, task_of


class KilnTaskData(vf.TaskData):  # type: ignore[misc]
    kiln_task: dict[str, Any]


class KilnTask(vf.Task[KilnTaskData]):  # type: ignore[misc]
    @vf.reward  # type: ignore[untyped-decorator]
    async def kiln(self, task: KilnTaskData, trace: Any) -> float:
        client = shared_client()
        verdicts = await client.submit(client.client.verify(task_of(task.kiln_task, task.prompt_text),
                                                            [trace.last_reply]))
        note_versions(verdicts)
        if verdicts[0].failure:
            raise vf.SandboxError(f"kiln could not judge the completion ({verdicts[0].failure}, "
                                  f"{verdicts[0].attempts} checks): {verdicts[0].reason[:500]}")
        return verdicts[0].reward
