"""Deprecated: ``kiln.workers.trainers.areal`` moved to ``kiln.integrations.trainers.areal``.
This path keeps working for one release — the same objects, with a ``DeprecationWarning`` — so trainer
configs that name it still run; name the new one."""

from __future__ import annotations

import warnings

from kiln.integrations.trainers.areal import async_reward_fn, reward_fn

__all__ = ["async_reward_fn", "reward_fn"]

warnings.warn("kiln.workers.trainers.areal is deprecated, use kiln.integrations.trainers.areal",
              DeprecationWarning, stacklevel=2)
