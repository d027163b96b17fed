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


# Runs in the exec session (see verifiers.ExecCheck): the sum is computed in the sandbox and each completion's
# leading number compared with it, as ``exact_match`` does in process.
ADDITION_CHECKER = """\
import json, re
for line in open("groups.jsonl"):
    group = json.loads(line)
    try:
        a, b = (int(x) for x in group["prompt"].rstrip("=").split("+"))
    except ValueError as e:
        print(json.dumps({"error": f"not an addition: {e}"}))
        continue
    verdicts = []
    for completion in group["completions"]:
        found = re.match(r"\\s*(-?\\d+)", completion)
        said = found.group(1) if found else None
        verdicts.append({"reward": 1.0 if said == str(a + b) else 0.0, "said": said})
    print(json.dumps({"verdicts": verdicts}))
"""


class Addition:
    """Digit addition written as text: ``"3+4="`` → ``"7"``. Held-out prompts are a fixed share of all pairs that
    training never samples. With ``exec_image`` every group is checked by the exec stage in a session on that image
    (which needs ``python3``) instead of in process."""

    def __init__(self, digits: int = 1, held_out_share: float = 0.25, seed: int = 0,
                 exec_image: str | None = None) -> None:
        self.exec_image = exec_image
        top = 10 ** digits
        pairs = [(a, b) for a in range(top) for b in range(top)]
        random.Random(seed).shuffle(pairs)
        cut = int(len(pairs) * held_out_share)
        self._held, self._train = pairs[:cut], pairs[cut:]
        self._rng = random.Random(seed + 1)

    def task(self, a: int, b: int) -> Task:
        task = Task(task_id=f"add-{a}-{b}", prompt=f"{a}+{b}=", answer=str(a + b))
        if self.exec_image is None:
            return task
        return task.model_copy(update={"verifier": "exec", "check": {
            "image": self.exec_image, "command": "python3 -I check.py", "files": {"check.py": ADDITION_CHECKER}}})

    def pairs(self) -> list[tuple[int, int]]:
        return self._train + self._held

    def sample(self, n: int) -> list[Task]:
        return [self.task(*self._rng.choice(self._train)) for _ in range(n)]

    def held_out(self) -> list[Task]:
        return [self.task(a, b) for a, b in self._held]


class Propositions:
    """Propositional goals for the Lean verifier (kiln's fake REPL understands them, and so does Lean): the
    completion is a tactic script."""

    STATEMENTS = ("p \u2192 p \u2227 True", "p \u2192 p", "a = a", "p \u2192 q \u2192 p", "True \u2227 True")

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    @staticmethod
    def task(index: int, statement: str) -> Task:
        return Task(task_id=f"prop-{index}", prompt=f"theorem : {statement} := by\n", verifier="lean",
                    check={"statement": statement})

    def sample(self, n: int) -> list[Task]:
        picks = [self._rng.randrange(len(self.STATEMENTS)) for _ in range(n)]
        return [self.task(i, self.STATEMENTS[i]) for i in picks]

    def held_out(self) -> list[Task]:
        return [self.task(i, s) for i, s in enumerate(self.STATEMENTS)]


_LEADING = re.compile(r"\s*(-?\d+)")


def exact_match(task: Task, completion: str) -> float:
    """1.0 when the number the completion starts with is the answer ("7", "7 ", "7\n…" for 7; not "77", "x7")."""
    found = _LEADING.match(completion)
    return 1.0 if found is not None and found.group(1) == task.answer else 0.0
