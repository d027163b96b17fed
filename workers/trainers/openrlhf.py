"""Deprecated: ``kiln.workers.trainers.openrlhf`` moved to ``kiln.integrations.trainers.openrlhf``.
This path keeps working for one release — the same objects, with a ``DeprecationWarning`` — so trainer
configs that name it still run; name the new one."""

from __future__ import annotations

import warnings

from kiln.integrations.trainers.openrlhf import RewardRequest, RewardResponse, completion_of, rewards

__all__ = ["RewardRequest", "RewardResponse", "completion_of", "rewards"]

warnings.warn("kiln.workers.trainers.openrlhf is deprecated, use kiln.integrations.trainers.openrlhf",
              DeprecationWarning, stacklevel=2)
