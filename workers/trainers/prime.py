"""Deprecated: ``kiln.workers.trainers.prime`` moved to ``kiln.integrations.trainers.prime``.
This path keeps working for one release — the same objects, with a ``DeprecationWarning`` — so trainer
configs that name it still run; name the new one."""

from __future__ import annotations

import warnings

from kiln.integrations.trainers.prime import KilnTask, KilnTaskData

__all__ = ["KilnTask", "KilnTaskData"]

warnings.warn("kiln.workers.trainers.prime is deprecated, use kiln.integrations.trainers.prime",
              DeprecationWarning, stacklevel=2)
