"""Fair queueing per client over a worker's read-ahead: which buffered job starts when a slot frees.

Each client (the request's ``kiln-client`` header) is charged the slot-seconds its jobs hold: finished jobs' run
time plus the time its running jobs have run so far, divided by its weight. A free slot goes to the client with the
least charge that has a startable job, so a flood and a trickle get equal slot time whatever partitions they share,
and a long job weighs what it costs. A client that goes idle is forgotten; when it comes back it starts at the least
charge among the active clients (no credit saved up while away, none lost behind a flood).

Within a client, jobs wait per partition in offset order and its partitions take turns. A job may be passed over
(its partition at its cap, its key running, its lane full). With ``keyed``, a job starts only when no job with its key
was buffered before it, whichever client sent that one, so a key's jobs start in offset order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
TP = tuple[str, int]
SCAN_LIMIT = 64
"""Jobs looked at per partition of a client for one pick: past a run of this many blocked ones the partition waits
(keyed stages: a partition whose first 64 jobs all wait on running keys)."""


@dataclass(eq=False)  # identity: a job is itself, whatever it carries
class Queued(Generic[T]):
    """One buffered job: where it came from, its key (keyed order) and what it occupies of the read-ahead."""

    tp: TP
    key: Hashable
    size: int
    item: T


@dataclass
class _Client(Generic[T]):
    weight: float
    charged: float = 0.0  # slot-seconds of finished jobs (plus the starting level it came back at)
    running: int = 0
    started_sum: float = 0.0  # sum of the start times of running jobs
    queues: dict[TP, deque[Queued[T]]] = field(default_factory=dict)
    queued: int = 0

    def charge(self, now: float) -> float:
        return (self.charged + self.running * now - self.started_sum) / self.weight


class FairQueue(Generic[T]):
    """Buffered jobs by client; ``pick`` takes the next one to start. Not thread-safe (the event loop owns it)."""

    def __init__(self, weights: dict[str, float] | None = None, default_weight: float = 1.0,
                 keyed: bool = False) -> None:
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.keyed = keyed
        self._clients: dict[str, _Client[T]] = {}
        self._by_key: dict[Hashable, deque[Queued[T]]] = {}  # keyed: each key's buffered jobs, in buffered order
        self.size = 0  # buffered jobs

    def __len__(self) -> int:
        return self.size

    @property
    def clients(self) -> int:
        """Clients with jobs buffered or running."""
        return len(self._clients)

    def _client(self, name: str, now: float) -> _Client[T]:
        client = self._clients.get(name)
        if client is None:
            client = _Client(self.weights.get(name, self.default_weight))
            if self._clients:  # back at the least charge of the active ones, in its own weight's units
                client.charged = min(c.charge(now) for c in self._clients.values()) * client.weight
            self._clients[name] = client
        return client

    def push(self, client_name: str, job: Queued[T], now: float) -> None:
        client = self._client(client_name, now)
        client.queues.setdefault(job.tp, deque()).append(job)
        if self.keyed:
            self._by_key.setdefault(job.key, deque()).append(job)
        client.queued += 1
        self.size += 1

    def pick(self, now: float, partition_open: Callable[[TP], bool],
             startable: Callable[[Queued[T]], bool]) -> tuple[str, Queued[T]] | None:
        """Remove and return the next job to start (and its client), or None when nothing buffered may start."""
        candidates = [(name, c) for name, c in self._clients.items() if c.queued]
        if len(candidates) > 1:
            candidates.sort(key=lambda nc: nc[1].charge(now))
        for name, client in candidates:
            for tp, waiting in list(client.queues.items()):
                if not partition_open(tp):
                    continue
                job = self._take(waiting, startable)
                if job is None:
                    continue
                if not waiting:
                    del client.queues[tp]
                else:  # its partitions take turns
                    client.queues[tp] = client.queues.pop(tp)
                client.queued -= 1
                self.size -= 1
                return name, job
        return None

    def _take(self, waiting: deque[Queued[T]], startable: Callable[[Queued[T]], bool]) -> Queued[T] | None:
        passed: set[Hashable] = set()
        for i, job in enumerate(waiting):
            if i >= SCAN_LIMIT:
                return None
            if job.key not in passed and (not self.keyed or self._by_key[job.key][0] is job) and startable(job):
                del waiting[i]
                if self.keyed:
                    self._unkey(job)
                return job
            passed.add(job.key)
        return None

    def _unkey(self, job: Queued[T]) -> None:
        same = self._by_key[job.key]
        same.remove(job)
        if not same:
            del self._by_key[job.key]

    def started(self, client_name: str, now: float) -> None:
        client = self._client(client_name, now)
        client.running += 1
        client.started_sum += now

    def finished(self, client_name: str, started_at: float, now: float) -> None:
        client = self._clients.get(client_name)
        if client is None:
            return
        client.running -= 1
        client.started_sum -= started_at
        client.charged += now - started_at
        self._forget_if_idle(client_name, client)

    def drop(self, tp: TP) -> list[Queued[T]]:
        """Remove every buffered job of partition ``tp`` (revoked); returns them."""
        dropped: list[Queued[T]] = []
        for name, client in list(self._clients.items()):
            waiting = client.queues.pop(tp, None)
            if waiting:
                dropped.extend(waiting)
                if self.keyed:
                    for job in waiting:
                        self._unkey(job)
                client.queued -= len(waiting)
                self.size -= len(waiting)
            self._forget_if_idle(name, client)
        return dropped

    def _forget_if_idle(self, name: str, client: _Client[T]) -> None:
        if not client.queued and not client.running:
            del self._clients[name]
