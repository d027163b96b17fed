"""``KilnRewardManager``: verl's reward-loop manager (verl 0.9.1, ``experimental/reward_loop/reward_manager/
base.py``: ``RewardManagerBase``) scoring each sample with kiln's verdict, and a completion kiln could not judge with
its group's mean of real verdicts (``GroupBaseline``, the group being the samples of one ``uid``): advantage 0 under
GRPO, the group's baseline unchanged. verl has no per-sample "no reward" (``kiln.integrations.trainers.verl``).

Configure verl with::

    reward.reward_manager.source=importlib
    reward.reward_manager.module.path=<path of this file>
    reward.reward_manager.name=KilnRewardManager
    reward.num_workers=1

One reward-loop worker, so that one manager sees every sample of a group: verl sends each sample to a random
worker (``experimental/agent_loop/agent_loop.py:1025``). The group size is ``actor_rollout_ref.rollout.n``; an
unjudged sample waits at most ``KILN_VERIFY_GROUP_WAIT_S`` for its group. verl's validation gives every sample a
``uid`` of its own (``trainer/ppo/ray_trainer.py:611``): an unjudged one there waits that long and counts 0 in the
validation metrics (training never sees it). A sample without a ``uid`` scores NaN, as ``compute_score`` does.

Imports verl: a module of its own, so that ``kiln.integrations.trainers.verl`` loads where verl is not installed.
"""

from __future__ import annotations

import math
from typing import Any

from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from kiln.integrations.trainers import note_versions, shared_client, task_of
from kiln.integrations.trainers.groups import GroupBaseline
from kiln.integrations.trainers.verl import extra_info_of, task_label
from kiln.workers.verify.client import VerifySettings


class KilnRewardManager(RewardManagerBase):  # type: ignore[misc]
    def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None, **kwargs: Any) -> None:
        del kwargs  # a reward model's router and tokenizer: kiln judges, no model does
        super().__init__(config, tokenizer, compute_score)
        rollout = config.get("actor_rollout_ref", {}).get("rollout", {})
        self.groups = GroupBaseline(int(rollout.get("n", 0) or 0), VerifySettings().group_wait_s)

    async def run_single(self, data: DataProto) -> dict[str, Any]:
        """One sample (the last sequence of a multi-sequence output, as verl's naive manager reads it)."""
        item = data[-1:][0]
        responses = item.batch["responses"]
        length = int(item.batch["attention_mask"][-responses.shape[-1]:].sum())
        text = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(responses[:length], skip_special_tokens=True))
        extra_info = item.non_tensor_batch.get("extra_info") or {}
        ground_truth = (item.non_tensor_batch.get("reward_model") or {}).get("ground_truth")
        client = shared_client()
        verdict = (await client.submit(client.client.verify(task_of(task_label(ground_truth, extra_info)),
                                                            [text])))[0]
        note_versions([verdict])
        uid = item.non_tensor_batch.get("uid")
        reward = await self.groups.reward(str(uid), verdict) if uid is not None else (
            math.nan if verdict.failure else verdict.reward)
        return {"reward_score": reward, "reward_extra_info": {"score": reward, **extra_info_of(verdict)}}
