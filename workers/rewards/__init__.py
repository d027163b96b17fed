"""Deprecated: ``kiln.workers.rewards`` moved to ``kiln.integrations.trainers.trl``.
This path keeps working for one release — the same objects, with a ``DeprecationWarning`` — so trainer
configs that name it still run; name the new one."""

from __future__ import annotations

import warnings

from kiln.integrations.trainers.trl import (
    RUNNERS,
    LeanProofAccepted,
    OutputMatches,
    TestsPassRatio,
    Verified,
    completion_text,
)

__all__ = ["RUNNERS", "LeanProofAccepted", "OutputMatches", "TestsPassRatio", "Verified", "completion_text"]

warnings.warn("kiln.workers.rewards is deprecated, use kiln.integrations.trainers.trl",
              DeprecationWarning, stacklevel=2)
