"""``KilnRLVRWorkflow``: AReaL's ``RLVRWorkflow`` (areal 1.0.4, ``workflow/rlvr.py``) whose reward is kiln's verdict,
awaited on the workflow's own event loop — not through ``AsyncRewardWrapper``, whose 15 s timeout scores a slower
check 0 — and whose episode raises ``NoReward`` when kiln could not judge the completion, so that AReaL rejects the
episode's group (``kiln.integrations.trainers.areal``: why a group, and not the one episode)::

    workflow = KilnRLVRWorkflow(gconfig=config.gconfig, tokenizer=tokenizer)

The task is the row's ``kiln_task`` column, else its ``answer`` or ``solution``. Imports AReaL: a module of its own,
so that ``kiln.integrations.trainers.areal`` loads where AReaL is not installed.
"""

from __future__ import annotations

from typing import Any

from areal.workflow.rlvr import RLVRWorkflow

from kiln.integrations.trainers import shared_client
from kiln.integrations.trainers.areal import judged, task_label


class KilnRLVRWorkflow(RLVRWorkflow):  # type: ignore[misc]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(reward_fn="kiln.integrations.trainers.areal.reward_fn", **kwargs)

    async def _compute_rewards(self, resp: Any, prompt_str: str, task_data: dict[str, Any]) -> float:
        client = shared_client()
        text = self.tokenizer.decode(resp.output_tokens)
        return judged((await client.submit(client.client.verify(task_label(prompt_str, task_data), [text])))[0])
