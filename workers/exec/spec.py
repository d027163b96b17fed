"""``exec``: ``exec.requests`` -> results. Keyed by session: one session's requests run in order, different sessions
concurrently."""

from __future__ import annotations

from kiln.schemas.exec import ExecRequest, ExecResult
from kiln.streams.stage import Deployment, StageSpec

exec_ = StageSpec("exec", "exec.requests", ExecRequest, ExecResult, handler="kiln.workers.exec.stage:stage",
                  ordering="keyed", partitions=32,
                  deployment=Deployment(slots=4, memory_per_slot_mib=2048, container_engine=True))
