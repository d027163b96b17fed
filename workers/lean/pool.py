"""A pool of REPL processes keyed by header, sized to the worker's slots, growing and shrinking with demand.

A lease for a proof state (its ancestry: the state's id, its parent's, ... its base's) prefers an idle process
holding the state (loose pinning); otherwise it weighs, in tactic steps, re-deriving the state on the idle process
holding its nearest ancestor (the steps left to replay; ``IMPORT_STEPS`` more from the base) against queueing for
a busy process that holds it (one step per request ahead); a new process costs ``SPAWN_STEPS`` more. Without a
state, or with nothing to weigh: an idle process with the header loaded, a new process while under the size, and
finally the least recently used idle process of another header is evicted. Processes are recycled after
``recycle_after`` requests and closed after ``idle_ttl_s`` idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kiln.workers.lean.repl import Header, ReplProcess


@dataclass
class PoolStats:
    spawned: int = 0
    header_hits: int = 0
    header_misses: int = 0
    pin_hits: int = 0
    pin_misses: int = 0
    retired: dict[str, int] = field(default_factory=dict)  # reason ("recycled", "timeout", "crash", ...) -> count


IMPORT_STEPS = 2
"""What importing or re-running a state's base costs, in tactic steps (a pickle load; a short command)."""
SPAWN_STEPS = 6
"""What starting a process with its header costs on top, in tactic steps."""


def replay_steps(proc: ReplProcess, ancestry: list[str]) -> int:
    """Steps for ``proc`` to reach the state whose ancestry this is (0: it holds the state)."""
    for depth, sid in enumerate(ancestry):
        if sid in proc.held:
            return depth
    return len(ancestry) - 1 + IMPORT_STEPS


class ReplPool:
    def __init__(self, factory: Callable[[Header], ReplProcess], size: int, idle_ttl_s: float = 600.0,
                 on_retire: Callable[[str], None] = lambda _reason: None) -> None:
        self.factory = factory
        self.on_retire = on_retire
        self.size = size
        self.idle_ttl_s = idle_ttl_s
        self.stats = PoolStats()
        self._idle: list[ReplProcess] = []  # most recently used last
        self._leased: set[ReplProcess] = set()
        self._queued: dict[ReplProcess, int] = {}  # busy process -> requests waiting for the state it holds
        self._count = 0
        self._changed = asyncio.Condition()
        self._reaper: asyncio.Task[None] | None = None

    @property
    def processes(self) -> int:
        return self._count

    def headers(self, *, leased: bool = False) -> dict[Header, int]:
        """Idle processes per header; with ``leased``, those running a request too."""
        counts: dict[Header, int] = {}
        for proc in [*self._idle, *(self._leased if leased else ())]:
            counts[proc.header] = counts.get(proc.header, 0) + 1
        return counts

    async def prewarm(self, headers: list[Header]) -> None:
        for header in headers[: self.size]:
            async with self.lease(header):
                pass

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_idle())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        async with self._changed:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        await asyncio.gather(*(p.close() for p in idle))

    @contextlib.asynccontextmanager
    async def lease(self, header: Header, ancestry: list[str] | None = None,
                    ) -> AsyncIterator[tuple[ReplProcess, bool]]:
        """A process with ``header`` loaded, exclusively; yields (process, whether the header was loaded already)."""
        proc, reused = await self._acquire(header, ancestry or [])
        self._leased.add(proc)
        try:
            yield proc, reused
        finally:
            self._leased.discard(proc)
            await self._release(proc)

    async def _acquire(self, header: Header, ancestry: list[str]) -> tuple[ReplProcess, bool]:
        evict: ReplProcess | None = None
        async with self._changed:
            while True:
                same = [p for p in self._idle if p.header == header]
                steps = {p: replay_steps(p, ancestry) for p in same} if ancestry else {}
                best = min(reversed(same), key=lambda p: steps.get(p, 0), default=None)  # ties: most recent
                holder = next((p for p in self._leased if p.header == header and ancestry[0] in p.held),
                              None) if ancestry else None
                alternative = steps.get(best, 0) if best is not None else len(ancestry) + IMPORT_STEPS + SPAWN_STEPS - 1
                if holder is not None and 1 + self._queued.get(holder, 0) < alternative:
                    self._queued[holder] = self._queued.get(holder, 0) + 1
                    try:
                        await self._changed.wait()
                    finally:
                        self._queued[holder] -= 1
                        if not self._queued[holder]:
                            del self._queued[holder]
                    continue
                if best is not None:
                    self._idle.remove(best)
                    if ancestry:
                        if steps[best] == 0:
                            self.stats.pin_hits += 1
                        else:
                            self.stats.pin_misses += 1
                    self.stats.header_hits += 1
                    return best, True
                if self._count < self.size:
                    self._count += 1
                    break
                others = [p for p in self._idle if p.header != header]
                if others:
                    evict = others[0]
                    self._idle.remove(evict)
                    break
                await self._changed.wait()
        if evict is not None:
            await evict.close()
        self.stats.header_misses += 1
        if ancestry:
            self.stats.pin_misses += 1
        proc = self.factory(header)
        try:
            await proc.start()
        except BaseException:
            async with self._changed:
                self._count -= 1
                self._changed.notify_all()
            await proc.close()
            raise
        self.stats.spawned += 1
        return proc, False

    async def _release(self, proc: ReplProcess) -> None:
        retire = not proc.alive or proc.requests >= proc.limits.recycle_after
        if retire:
            reason = "recycled" if proc.alive else proc.exit_reason or "exit"
            self.stats.retired[reason] = self.stats.retired.get(reason, 0) + 1
            self.on_retire(reason)
            await proc.close()
        async with self._changed:
            if retire:
                self._count -= 1
            else:
                self._idle.append(proc)
            self._changed.notify_all()

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.idle_ttl_s / 2))
            cutoff = time.monotonic() - self.idle_ttl_s
            async with self._changed:
                stale = [p for p in self._idle if p.last_used < cutoff]
                for p in stale:
                    self._idle.remove(p)
                self._count -= len(stale)
                self._changed.notify_all()
            await asyncio.gather(*(p.close() for p in stale))
