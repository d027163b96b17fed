"""Task sources: where prompts and their checkable answers come from. A user plugs in their own by implementing
``TaskSource``."""

from __future__ import annotations

import random
from typing import Any, Protocol

from pydantic import BaseModel, Field

from kiln.schemas.rl import RolloutTask as Task
from kiln.workers.common.errors import NoHealthyTasks
from kiln.workers.common.swe import TaskValidation, task_id
from kiln.workers.common.task_health import TaskHealthBoard
from kiln.workers.verifiers import InvalidTask, exact_match

__all__ = ["Addition", "Problem", "Propositions", "RepositoryTasks", "TaskSource", "exact_match"]


class TaskSource(Protocol):
    def sample(self, n: int) -> list[Task]: ...

    def held_out(self) -> list[Task]: ...


# Runs in the exec session (see verifiers.ExecCheck): the sum is computed in the sandbox and each completion's
# leading number compared with it, as ``exact_match`` does in process.
ADDITION_CHECKER = """\
import json, re
for line in open("groups.jsonl"):
    group = json.loads(line)
    operands = re.fullmatch(r"[a-z ]*(\\d+)\\s*\\+\\s*(\\d+)\\s*=\\s*", group["prompt"])
    if operands is None:
        print(json.dumps({"error": "not an addition: " + group["prompt"][:40]}))
        continue
    total = str(int(operands.group(1)) + int(operands.group(2)))
    verdicts = []
    for completion in group["completions"]:
        found = re.match(r"\\s*(-?\\d+)", completion)
        said = found.group(1) if found else None
        verdicts.append({"reward": 1.0 if said == total else 0.0, "said": said})
    print(json.dumps({"verdicts": verdicts}))
"""


class Addition:
    """Digit addition written as text: ``"add 3+4="`` → ``"7"``, each pair under three instruction words. Held-out
    prompts: for every pair, the one word that training never shows it with — each held-out prompt's pair and its
    word were both trained, never together, so a policy that memorised prompt strings scores nothing on them. (Pairs
    never seen at all are not learnable from scratch by RL in minutes: measured on this machine, a quarter of the
    pairs held out rose to at most 0.16.) With ``exec_image`` every group is checked by the exec stage in a session
    on that image (which needs ``python3``) instead of in process."""

    PHRASINGS = ("add {a}+{b}=", "sum {a}+{b}=", "get {a}+{b}=")

    def __init__(self, digits: int = 1, seed: int = 0, exec_image: str | None = None) -> None:
        self.exec_image = exec_image
        top = 10 ** digits
        pairs = [(a, b) for a in range(top) for b in range(top)]
        random.Random(seed).shuffle(pairs)
        # Round robin over the shuffled pairs: each phrasing is held out for an equal share of them.
        held = {(a, b, i % len(self.PHRASINGS)) for i, (a, b) in enumerate(pairs)}
        self._held = sorted(held)
        self._train = [(a, b, p) for a, b in sorted(pairs) for p in range(len(self.PHRASINGS))
                       if (a, b, p) not in held]
        self._rng = random.Random(seed + 1)

    def task(self, a: int, b: int, phrasing: int = 0) -> Task:
        task = Task(task_id=f"add-{a}-{b}-{phrasing}", prompt=self.PHRASINGS[phrasing].format(a=a, b=b),
                    answer=str(a + b))
        if self.exec_image is None:
            return task
        return task.model_copy(update={"verifier": "exec", "check": {
            "image": self.exec_image, "command": "python3 -I check.py", "files": {"check.py": ADDITION_CHECKER}}})

    def sample(self, n: int) -> list[Task]:
        return [self.task(*self._rng.choice(self._train)) for _ in range(n)]

    def held_out(self) -> list[Task]:
        return [self.task(*held) for held in self._held]


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


class Problem(BaseModel):
    """One repository task: what to do, and the tests that say it is done (applied after the candidate patch):
    FAIL_TO_PASS / PASS_TO_PASS as ``kiln tasks validate`` found them (``Problem.validated``); a problem without
    them is judged by its test command's exit status and the tests its test patch adds."""

    problem_id: str
    statement: str
    test_patch: str = ""
    fail_to_pass: list[str] = Field(default_factory=list)
    pass_to_pass: list[str] = Field(default_factory=list)

    @classmethod
    def validated(cls, problem_id: str, statement: str, test_patch: str, validation: TaskValidation) -> Problem:
        """A problem carrying a validation's FAIL_TO_PASS / PASS_TO_PASS; an invalid task is refused."""
        if not validation.valid:
            raise InvalidTask(f"task {problem_id} is not valid: {validation.reason}")
        return cls(problem_id=problem_id, statement=statement, test_patch=test_patch,
                   fail_to_pass=validation.fail_to_pass, pass_to_pass=validation.pass_to_pass)


class RepositoryTasks:
    """SWE-style tasks on a repository revision's built image: the policy may run commands in its own session
    (``<run>…</run>``, up to ``max_turns`` turns) and answers with ``<patch>unified diff</patch>``; the repository's
    tests with the task's test patch are the reward (``swe`` verifier).

    With ``health`` (the ``kiln.tasks.health`` board, ``kiln tasks health``) neither ``sample`` nor ``held_out`` ever
    returns a task the board has quarantined as of its last read (read again every ``refresh_s``), and ``sample``
    raises ``NoHealthyTasks`` when none is left."""

    def __init__(self, repository: str, image: str, problems: list[Problem], max_turns: int = 4,
                 test_command: str | None = None, seed: int = 0, health: TaskHealthBoard | None = None) -> None:
        self.repository, self.image, self.problems, self.max_turns = repository, image, problems, max_turns
        self.test_command = test_command
        self.health = health
        self._rng = random.Random(seed)

    def task_id(self, problem: Problem) -> str:
        return task_id(self.repository, problem.problem_id)

    def served(self) -> list[Problem]:
        """The problems not quarantined (all of them without a health board)."""
        if self.health is None:
            return list(self.problems)
        quarantined = self.health.quarantined()
        return [p for p in self.problems if self.task_id(p) not in quarantined]

    def task(self, problem: Problem) -> Task:
        check: dict[str, Any] = {"image": self.image, "test_patch": problem.test_patch}
        if problem.fail_to_pass:
            check.update(fail_to_pass=problem.fail_to_pass, pass_to_pass=problem.pass_to_pass)
        elif self.test_command is not None:
            check["test_command"] = self.test_command
        prompt = (f"Repository {self.repository}. {problem.statement}\n"
                  "Run commands as <run>command</run>; answer with <patch>unified diff</patch>.\n")
        return Task(task_id=self.task_id(problem), prompt=prompt, verifier="swe", check=check,
                    max_turns=self.max_turns)

    def sample(self, n: int) -> list[Task]:
        problems = self.served()
        if not problems:
            raise NoHealthyTasks(f"all {len(self.problems)} tasks of {self.repository} are quarantined "
                                 "(kiln tasks board)")
        return [self.task(self._rng.choice(problems)) for _ in range(n)]

    def held_out(self) -> list[Task]:
        return [self.task(p) for p in self.served()]
