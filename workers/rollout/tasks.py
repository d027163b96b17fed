"""Task sources: where prompts and their checkable answers come from. A user plugs in their own by implementing
``TaskSource``."""

from __future__ import annotations

import random
import re
from typing import Protocol

from kiln.schemas.rl import RolloutTask as Task


class TaskSource(Protocol):
    def sample(self, n: int) -> list[Task]: ...

    def held_out(self) -> list[Task]: ...


class Addition:
    """Digit addition written as text: ``"3+4="`` → ``"7"``. Held-out prompts are a fixed share of all pairs that
    training never samples."""

    def __init__(self, digits: int = 1, held_out_share: float = 0.25, seed: int = 0) -> None:
        top = 10 ** digits
        pairs = [(a, b) for a in range(top) for b in range(top)]
        random.Random(seed).shuffle(pairs)
        cut = int(len(pairs) * held_out_share)
        self._held, self._train = pairs[:cut], pairs[cut:]
        self._rng = random.Random(seed + 1)

    @staticmethod
    def task(a: int, b: int) -> Task:
        return Task(task_id=f"add-{a}-{b}", prompt=f"{a}+{b}=", answer=str(a + b))

    def sample(self, n: int) -> list[Task]:
        return [self.task(*self._rng.choice(self._train)) for _ in range(n)]

    def held_out(self) -> list[Task]:
        return [self.task(a, b) for a, b in self._held]


_LEADING = re.compile(r"\s*(-?\d+)")


def exact_match(task: Task, completion: str) -> float:
    """1.0 when the number the completion starts with is the answer ("7", "7 ", "7\n…" for 7; not "77", "x7")."""
    found = _LEADING.match(completion)
    return 1.0 if found is not None and found.group(1) == task.answer else 0.0
