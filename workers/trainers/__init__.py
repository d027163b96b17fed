"""Deprecated: ``kiln.workers.trainers`` moved to ``kiln.integrations.trainers``.
This path keeps working for one release — the same objects, with a ``DeprecationWarning`` — so trainer
configs that name it still run; name the new one."""

from __future__ import annotations

import warnings

from kiln.integrations.trainers import configure, shared_client, task_of

__all__ = ["configure", "shared_client", "task_of"]

warnings.warn("kiln.workers.trainers is deprecated, use kiln.integrations.trainers",
              DeprecationWarning, stacklevel=2)
