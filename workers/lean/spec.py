"""``lean``: ``lean.requests`` -> results. Unordered: a proof state travels with the request, so any worker serves
it (follow-ups are keyed by the state's affinity only to reach the process that still holds it)."""

from __future__ import annotations

from kiln.schemas.lean import LeanRequest, LeanResult
from kiln.streams.stage import Deployment, StageSpec

lean = StageSpec("lean", "lean.requests", LeanRequest, LeanResult, handler="kiln.workers.lean.stage:stage",
                 partitions=32, deployment=Deployment(spare_cpu=True))
