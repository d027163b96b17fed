"""Breadth-first proof search over the Lean stage: expand every frontier state by every candidate tactic in
parallel (the requests spread over all Lean workers), stop at the first completed proof."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kiln.schemas.lean import LeanResult, ProofStateRef

RunTactic = Callable[[ProofStateRef, str], Awaitable[LeanResult]]
Candidates = Callable[[ProofStateRef], Sequence[str]]


@dataclass
class SearchOutcome:
    proof: list[str] | None
    """The tactics from the root to a completed proof, or None when none was found within the limits."""
    expanded: int = 0
    lean_errors: int = 0
    depth: int = 0
    frontier_sizes: list[int] = field(default_factory=list)


async def breadth_first(run_tactic: RunTactic, root: ProofStateRef, candidates: Candidates, *, max_depth: int = 4,
                        max_nodes: int = 2000) -> SearchOutcome:
    async def expand(state: ProofStateRef, path: list[str], tactic: str) -> tuple[list[str], LeanResult]:
        return [*path, tactic], await run_tactic(state, tactic)

    outcome = SearchOutcome(proof=None)
    frontier: list[tuple[ProofStateRef, list[str]]] = [(root, [])]
    seen: set[tuple[str, ...]] = {tuple(root.goals)}
    for depth in range(1, max_depth + 1):
        outcome.depth = depth
        outcome.frontier_sizes.append(len(frontier))
        jobs: list[asyncio.Task[tuple[list[str], LeanResult]]] = []
        for state, path in frontier:
            for tactic in candidates(state):
                if outcome.expanded + len(jobs) >= max_nodes:
                    break
                jobs.append(asyncio.ensure_future(expand(state, path, tactic)))
        if not jobs:
            return outcome
        next_frontier: list[tuple[ProofStateRef, list[str]]] = []
        try:
            for done in asyncio.as_completed(jobs):
                path, result = await done
                outcome.expanded += 1
                if result.completed:
                    outcome.proof = path
                    return outcome
                if not result.ok or result.state is None:
                    outcome.lean_errors += 1
                    continue
                goals = tuple(result.goals)
                if goals not in seen:
                    seen.add(goals)
                    next_frontier.append((result.state, path))
        finally:
            for task in jobs:
                task.cancel()  # results of abandoned branches are dropped by the client when they arrive
        frontier = next_frontier
    return outcome
