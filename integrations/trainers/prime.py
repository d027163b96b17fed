"""prime-rl / ``verifiers`` (0.4, ``verifiers.v1``): ``KilnTask``, a task whose reward is kiln's verdict on the
trace's last reply. Its data carries the kiln task (``kiln_task``: the ``RolloutTask`` fields) beside the prompt;
an environment's taskset yields ``KilnTask(KilnTaskData(prompt=..., kiln_task={...}))``. Needs ``verifiers``
installed (not a kiln dependency). The reward is a float: the verifier version goes to the ``kiln.rewards`` log the
first time a process sees it (``note_versions``)."""

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
        return verdicts[0].reward
