"""A pool of REPL processes keyed by header, sized to the worker's slots, growing and shrinking with demand.

A lease prefers, in order: an idle process holding the wanted proof state (loose pinning), an idle process with
the header loaded, a new process while under the size, and finally evicts the least recently used idle process of
another header. Processes are recycled after ``recycle_after`` requests and closed after ``idle_ttl_s`` idle.
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
    async def lease(self, header: Header, state_id: str | None = None) -> AsyncIterator[tuple[ReplProcess, bool]]:
        """A process with ``header`` loaded, exclusively; yields (process, whether the header was loaded already)."""
        proc, reused = await self._acquire(header, state_id)
        self._leased.add(proc)
        try:
            yield proc, reused
        finally:
            self._leased.discard(proc)
            await self._release(proc)

    async def _acquire(self, header: Header, state_id: str | None) -> tuple[ReplProcess, bool]:
        evict: ReplProcess | None = None
        async with self._changed:
            while True:
                same = [p for p in self._idle if p.header == header]
                if same:
                    pinned = [p for p in same if state_id is not None and state_id in p.held]
                    proc = (pinned or same)[-1]
                    self._idle.remove(proc)
                    if state_id is not None:
                        if pinned:
                            self.stats.pin_hits += 1
                        else:
                            self.stats.pin_misses += 1
                    self.stats.header_hits += 1
                    return proc, True
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
        if state_id is not None:
            self.stats.pin_misses += 1
        proc = self.factory(header)
        try:
            await proc.start()
        except BaseException:
            async with self._changed:
                self._count -= 1
                self._changed.notify()
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
            self._changed.notify()

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
