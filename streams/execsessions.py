"""Client side of exec sessions: the handle a trainer keeps, and how requests are routed.

A session lives on the worker that opened it: every later request goes to that partition, keyed by the session id
(so they run in the order sent, even pipelined). ``open`` is keyed by repository so one worker serves a
repository's sessions; past ``sessions_per_key`` open sessions of one repository (from this client) new ones use
the next key ``repo#1``, ``repo#2``, …, which hash to other partitions: a hot repository spills over instead of
queueing behind one worker.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExecSession:
    session_id: str
    token: str
    partition: int
    image: str
    repository: str = ""


@dataclass
class SpillOver:
    sessions_per_key: int = 4
    open_by_repository: Counter[str] = field(default_factory=Counter)

    def key_for(self, repository: str) -> str:
        return f"{repository}#{self.open_by_repository[repository] // max(1, self.sessions_per_key)}"

    def opened(self, repository: str) -> None:
        self.open_by_repository[repository] += 1

    def closed(self, repository: str) -> None:
        if self.open_by_repository[repository] > 0:
            self.open_by_repository[repository] -= 1
