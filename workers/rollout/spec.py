"""Spec of the ``rollout`` stage: one prompt group per request; every group also goes to ``rollouts``, which the
trainer consumes."""

from __future__ import annotations

from kiln.schemas.rl import RolloutGroup, RolloutRequest
from kiln.streams.stage import StageSpec


def _facets(group: RolloutGroup) -> dict[str, str | float]:
    """The policy version sampled with and how many updates landed while the group was sampled (its lag)."""
    rewards = [s.reward for s in group.samples]
    return {"policy_version": float(group.version_end), "lag_versions": float(group.version_end - group.version_start),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0}


rollout = StageSpec("rollout", "rollout.requests", RolloutRequest, RolloutGroup,
                    handler="kiln.workers.rollout.stage:stage", partitions=16, events_topic="rollouts",
                    events_partitions=4, facets=_facets)
