"""``exact_match``: in process, the number a completion starts with equals the task's answer."""

from __future__ import annotations

import re

from kiln.schemas.rl import RolloutTask
from kiln.workers.verifiers.contract import Verdict

_LEADING = re.compile(r"\s*(-?\d+)")


def exact_match(task: RolloutTask, completion: str) -> float:
    """1.0 when the number the completion starts with is the answer ("7", "7 ", "7\n…" for 7; not "77", "x7")."""
    found = _LEADING.match(completion)
    return 1.0 if found is not None and found.group(1) == task.answer else 0.0


class ExactMatch:
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        return [Verdict(reward=exact_match(task, c)) for c in completions]

    async def close(self) -> None:
        pass
