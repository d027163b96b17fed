"""Spec of the ``rollout`` stage: one prompt group per request; every group also goes to ``rollouts``, which the
trainer consumes."""

from __future__ import annotations

from kiln.schemas.rl import RolloutGroup, RolloutRequest
from kiln.streams.stage import StageSpec

rollout = StageSpec("rollout", "rollout.requests", RolloutRequest, RolloutGroup,
                    handler="kiln.workers.rollout.stage:stage", partitions=16, events_topic="rollouts",
                    events_partitions=4)
