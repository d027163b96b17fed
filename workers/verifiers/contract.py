"""What every verifier shares: the contract a verifier implements (``Verifier``: a task and a group of completions in,
one verdict per completion out), what it may use (``VerifierContext``), its verdict, and how it reads a task's check.

A verdict is the ``verify`` stage's wire type, ``CompletionVerdict`` (``kiln.schemas.verify``), named ``Verdict``
here: a verifier sets ``reward``, ``details`` (what the sample's record and the verify result carry), and one of two
kinds of failure, never confused:

- ``policy_failure`` (``PolicyFailure``): the completion's own run, measured outside it, failed — it ran past its
  limit, exited nonzero or was killed by a signal (a fork bomb hitting the pids limit, a memory bomb killed by the
  OOM killer, a process that killed its own group, a program whose stdout was closed), outgrew its memory, or
  flooded its output past the cap. A real verdict: reward 0 (``measured``, ``POLICY_ERRORS``).
- ``failure`` (``Failure``): kiln could not judge it — no sandbox, a job lost or failed for good, a checker that
  broke, a check past its own time. No reward; retried within a budget before it is reported
  (``kiln.workers.verify.client.rechecked``).

The verify stage fills in the rest (``reason``, the test counts, the time).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from kiln.schemas.exec import CommandOutput
from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import CompletionVerdict, FailureKind, PolicyFailure, SentTogether
from kiln.streams.client import KilnClient
from kiln.streams.errors import ClientError, RequestFailed
from kiln.workers.exec.client import ExecClient
from kiln.workers.lean.client import LeanClient
from kiln.workers.verifiers.errors import InvalidTask, SandboxError

Verdict = CompletionVerdict
Failure = FailureKind
"""Why kiln gave a completion no real verdict (it then has no reward): the check as a whole ran past its time
(``timeout``: a checker's own run, never the completion's program), the sandbox could not run it
(``sandbox_error``), the task cannot be checked as given (``invalid_task``), the checker failed or answered nonsense
(``checker_error``), or the verify request itself got no answer (``unavailable``, only from a client)."""
FAILURES: tuple[str, ...] = get_args(Failure)
POLICY_FAILURES: tuple[str, ...] = get_args(PolicyFailure)
POLICY_ERRORS: dict[str, PolicyFailure] = {"ReplTimeout": "timeout", "ReplMemoryExceeded": "memory"}
"""Errors a stage answers after it measured the completion's own run past its bounds (the Lean stage: a proof past
its time, a REPL past its memory bound; the process was killed): the completion's failure, a real verdict."""


def measured(output: CommandOutput) -> PolicyFailure | None:
    """The completion's own failure in a run its sandbox's supervisor measured: past its time, its stdout past the
    cap, or ended by a signal or a nonzero exit (None: it ran and exited 0; whether it was right is the checker's)."""
    if output.timed_out:
        return "timeout"
    if output.stdout_truncated:
        return "output_limit"
    if output.exit_code != 0:
        return "crashed"
    return None


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


SENT_TOGETHER: ContextVar[SentTogether | None] = ContextVar("kiln_sent_together", default=None)
"""The requests the one being judged was sent with (``VerifyRequest.sent_together``), set by the verify stage around
its judging: a verifier that batches requests (``ExecVerifier``) waits for the rest of them."""

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
        """A job that failed for good (or expired, or whose result was lost). The stage's measure of the completion's
        own run (``POLICY_ERRORS``) is a real verdict of 0; anything else is kiln's: a ``sandbox_error`` verdict, or
        for the rollout stage a ``SandboxError`` (its group is retried)."""
        reason = e.reason if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
        own = POLICY_ERRORS.get(e.error_type) if isinstance(e, RequestFailed) else None
        if own is not None:
            return Verdict(reward=0.0, details={"error": reason[:500]}, policy_failure=own)
        if not self.failures_as_verdicts:
            raise SandboxError(reason) from None
        return Verdict(reward=0.0, details={"error": reason[:500]}, failure="sandbox_error")
