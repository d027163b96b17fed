"""What every verifier shares: the contract a verifier implements (``Verifier``: a task and a group of completions in,
one verdict per completion out), what it may use (``VerifierContext``), its verdict, and how it reads a task's check.

A verdict is the ``verify`` stage's wire type, ``CompletionVerdict`` (``kiln.schemas.verify``), named ``Verdict``
here: a verifier sets ``reward``, ``details`` (what the sample's record and the verify result carry) and, when the
completion got no real verdict, ``failure``; the verify stage fills in the rest (``reason``, the test counts, the
time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import CompletionVerdict, FailureKind
from kiln.streams.client import KilnClient
from kiln.streams.errors import ClientError, RequestFailed
from kiln.workers.exec.client import ExecClient
from kiln.workers.lean.client import LeanClient
from kiln.workers.verifiers.errors import InvalidTask, SandboxError

Verdict = CompletionVerdict
Failure = FailureKind
"""Why a completion has no real verdict (its reward is then 0): its check ran past its time (``timeout``), the
sandbox could not run it (``sandbox_error``), the task cannot be checked as given (``invalid_task``), the checker
failed or answered nonsense (``checker_error``), or the verify request itself got no answer (``unavailable``, only
from a client)."""
FAILURES: tuple[str, ...] = get_args(Failure)


class Verifier(Protocol):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]: ...

    async def close(self) -> None: ...


@dataclass
class VerifierContext:
    """What a verifier may use: the worker's client of the other stages."""

    kiln: KilnClient
    exec_calls: int = 4
    exec_batch_groups: int = 32
    exec_batch_window_s: float = 0.02
    exec_batch_quiet_s: float = 0.005
    failures_as_verdicts: bool = False  # per completion: a typed failed verdict instead of failing the whole group


_M = TypeVar("_M", bound=BaseModel)


def checked(model: type[_M], task: RolloutTask) -> _M:
    try:
        return model.model_validate(task.check)
    except ValidationError as e:
        raise InvalidTask(f"task {task.task_id}: check for {task.verifier!r} is invalid: {e}") from None


class PerCompletion:
    """A ``run_once`` call (or Lean job) per completion, all in flight at once: sample code runs alone."""

    def __init__(self, context: VerifierContext) -> None:
        self.exec = ExecClient(context.kiln)
        self.lean = LeanClient(context.kiln)
        self.failures_as_verdicts = context.failures_as_verdicts

    async def close(self) -> None:
        pass

    def failed(self, e: ClientError) -> Verdict:
        """A job that failed for good (or expired, or whose result was lost): the completion's typed verdict, or
        for the rollout stage a ``SandboxError`` (its group is retried)."""
        reason = e.reason if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
        if not self.failures_as_verdicts:
            raise SandboxError(reason) from None
        return Verdict(reward=0.0, details={"error": reason[:500]},
                       failure="timeout" if "Timeout" in reason else "sandbox_error")
