"""The least harmful "no reward" for trainers that have none per sample (verl, OpenRLHF): a completion kiln could not
judge gets the mean of its group's real verdicts.

A group-relative advantage (GRPO, Dr.GRPO; RLOO for that sample) subtracts the group's mean: the imputed sample's
advantage is then exactly 0 and the group's mean is the one its real verdicts give — the sample moves nothing, as if
left out (a standard deviation taken over the whole group shrinks by the imputed samples' share: the real ones'
advantages grow by at most that factor, their signs never change). A group with no real verdict gets a constant, 0:
every advantage in it is 0. A 0 for the failed sample instead would be a fake failure: a negative advantage for a
completion never judged, positive ones for every real failure of its group.

These trainers score a group's samples one by one, so the group meets here: a real verdict answers at once and is
remembered under its group's key; an unjudged one waits until ``size`` samples of its group have arrived (or
``wait_s`` passed: the mean of the real verdicts it has seen by then, else 0). A group that reached ``size`` is
forgotten, so the same key in a later step starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field

from kiln.schemas.verify import CompletionVerdict


@dataclass
class _Group:
    real: list[float] = field(default_factory=list)
    arrived: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class GroupBaseline:
    """Rewards of one trainer's groups, keyed by what the trainer gives a group (verl: the sample's ``uid``; OpenRLHF:
    its prompt and label). ``size``: samples per group (0: unknown, an unjudged sample waits ``wait_s``); at most
    ``keep`` groups are remembered (the oldest forgotten first)."""

    def __init__(self, size: int, wait_s: float, keep: int = 65536) -> None:
        self.size, self.wait_s, self.keep = size, wait_s, keep
        self._groups: OrderedDict[str, _Group] = OrderedDict()

    def _group(self, key: str) -> _Group:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
            while len(self._groups) > self.keep:
                self._groups.popitem(last=False)
        return group

    async def reward(self, key: str, verdict: CompletionVerdict) -> float:
        """The verdict's reward; for one without (``failure``), its group's imputed baseline."""
        group = self._group(key)
        async with group.changed:
            group.arrived += 1
            if not verdict.failure:
                group.real.append(verdict.reward)
            if self.size and group.arrived >= self.size:
                self._groups.pop(key, None)  # complete: the key's next sample starts a new group
            group.changed.notify_all()
            if not verdict.failure:
                return verdict.reward
            with contextlib.suppress(TimeoutError):  # then the mean of what it has seen
                await asyncio.wait_for(group.changed.wait_for(lambda: bool(self.size) and group.arrived >= self.size),
                                       self.wait_s)
            return sum(group.real) / len(group.real) if group.real else 0.0
