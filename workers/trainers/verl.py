"""Deprecated: ``kiln.workers.trainers.verl`` moved to ``kiln.integrations.trainers.verl``.
This path keeps working for one release — the same objects, with a ``DeprecationWarning`` — so trainer
configs that name it still run; name the new one."""

from __future__ import annotations

import warnings

from kiln.integrations.trainers.verl import compute_score, compute_score_batch

__all__ = ["compute_score", "compute_score_batch"]

warnings.warn("kiln.workers.trainers.verl is deprecated, use kiln.integrations.trainers.verl",
              DeprecationWarning, stacklevel=2)
