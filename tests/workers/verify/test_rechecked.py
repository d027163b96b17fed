"""The verify client's retry policy (``rechecked``), on a check that answers as scripted: what kiln failed to judge is
checked again, only those completions, each time after the backoff, until a real verdict, the attempts or the budget
run out; an unreadable task is not checked again. (Against the real stages: the typed-failures test and
bench/fake_zeros.py, where exec workers are killed and runners removed mid-batch.)"""

from __future__ import annotations

import time

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import CompletionVerdict, FailureKind
from kiln.workers.verify.client import VerifySettings, rechecked

TASK = RolloutTask(task_id="t", prompt="")


class Scripted:
    """Answers each check from a script: per call, a failure kind (or None: a real verdict) per completion."""

    def __init__(self, *answers: dict[str, FailureKind | None]) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []
        self.at: list[float] = []

    async def __call__(self, task: RolloutTask, completions: list[str]) -> list[CompletionVerdict]:
        self.calls.append(completions)
        self.at.append(time.monotonic())
        answer = self.answers.pop(0) if self.answers else {}
        return [CompletionVerdict(reward=0.0, failure=answer[c], reason="lost") if answer.get(c)
                else CompletionVerdict(reward=1.0) for c in completions]


async def test_only_kilns_failures_are_checked_again_until_real() -> None:
    check = Scripted({"a": "sandbox_error", "b": None, "c": "unavailable"}, {"a": "checker_error", "c": None}, {})
    verdicts = await rechecked(check, TASK, ["a", "b", "c"], VerifySettings(retry_attempts=4, retry_backoff_s=0.05))
    assert check.calls == [["a", "b", "c"], ["a", "c"], ["a"]]
    assert [(v.reward, v.failure, v.attempts) for v in verdicts] == [(1.0, None, 3), (1.0, None, 1), (1.0, None, 2)]
    assert check.at[2] - check.at[1] >= 2 * 0.05 * 0.9  # the backoff doubles


async def test_what_stays_kilns_failure_after_the_attempts_is_reported() -> None:
    check = Scripted(*[{"a": "timeout"}] * 5)
    verdicts = await rechecked(check, TASK, ["a"], VerifySettings(retry_attempts=3, retry_backoff_s=0.01))
    assert len(check.calls) == 3 and (verdicts[0].failure, verdicts[0].attempts) == ("timeout", 3)


async def test_an_unreadable_task_and_a_spent_budget_are_not_retried() -> None:
    unreadable = Scripted({"a": "invalid_task"})
    assert (await rechecked(unreadable, TASK, ["a"], VerifySettings()))[0].failure == "invalid_task"
    assert len(unreadable.calls) == 1
    spent = Scripted(*[{"a": "sandbox_error"}] * 5)  # the next backoff would end past the budget
    verdicts = await rechecked(spent, TASK, ["a"], VerifySettings(retry_budget_s=0.5, retry_backoff_s=1))
    assert len(spent.calls) == 1 and verdicts[0].failure == "sandbox_error"
    deadline = Scripted(*[{"a": "sandbox_error"}] * 5)
    await rechecked(deadline, TASK, ["a"], VerifySettings(retry_backoff_s=0.2), deadline=time.monotonic() + 0.1)
    assert len(deadline.calls) == 1
