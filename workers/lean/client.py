"""Client facade of the ``lean`` stage: run code, apply tactics, search for proofs across workers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kiln.schemas.lean import LeanRequest, LeanResult, ProofStateRef
from kiln.streams.client import KilnClient
from kiln.workers.lean.search import SearchOutcome, breadth_first


class LeanClient:
    """Lean requests over a shared ``KilnClient``."""

    def __init__(self, kiln: KilnClient) -> None:
        self.kiln = kiln

    async def run_code(self, code: str, *, header: list[str] | None = None, timeout_s: float = 60.0,
                       key: str | None = None) -> LeanResult:
        """Run Lean code (its leading ``import`` lines choose the REPL process); one proof state per ``sorry``."""
        request = LeanRequest(op="run_code", code=code, header=header or [], timeout_s=timeout_s)
        result: LeanResult = await self.kiln.call("lean", request, key=key)
        return result

    async def run_tactic(self, state: ProofStateRef, tactic: str, *, timeout_s: float = 30.0) -> LeanResult:
        """Apply ``tactic`` to ``state``; keyed by the state's affinity so it tends to reach the worker holding it."""
        request = LeanRequest(op="run_tactic", state=state, tactic=tactic, timeout_s=timeout_s)
        result: LeanResult = await self.kiln.call("lean", request, key=state.affinity or None)
        return result

    async def explore(self, root: ProofStateRef, candidates: Callable[[ProofStateRef], Sequence[str]] | Sequence[str],
                      *, max_depth: int = 4, max_nodes: int = 2000) -> SearchOutcome:
        """Breadth-first search from ``root`` over candidate tactics, in parallel across workers; stops at the first
        completed proof."""
        pick = candidates if callable(candidates) else (lambda _state: candidates)
        return await breadth_first(self.run_tactic, root, pick, max_depth=max_depth, max_nodes=max_nodes)
