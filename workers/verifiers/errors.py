"""The verifiers' errors. A group's check that fails routinely is a ``VerifyError`` (typed by ``failure``); a stage the
verifier relies on that could not run the check is a ``SandboxError``."""

from __future__ import annotations

from kiln.schemas.verify import CompletionVerdict, FailureKind
from kiln.streams.errors import JobError, RoutineJobError, TransientJobError


class VerifyError(RoutineJobError):
    """A routine failure of a whole group's check, typed by ``failure``: the rollout stage answers it as an error,
    the verify stage as that failure on every completion of the group."""

    failure: FailureKind = "checker_error"


class InvalidTask(VerifyError):
    failure = "invalid_task"


class CheckTimeout(VerifyError):
    failure = "timeout"


class SandboxError(TransientJobError):
    """The stage a verifier relies on could not run the check (its request failed for good): transient for the
    rollout stage (the group is retried), ``sandbox_error`` for the verify stage."""

    failure: FailureKind = "sandbox_error"


def unjudged(verdicts: list[CompletionVerdict]) -> JobError | None:
    """The error a group answers when kiln gave any of its completions no real verdict (the rollout stage: a group
    is trained on whole, so a sample without a reward is never sent as a 0): an unreadable task or a broken checker
    is routine (answered as an error), a sandbox that failed or a check past its time transient (the group is
    retried, then dead-lettered). None when every verdict is real."""
    failed = [v for v in verdicts if v.failure]
    if not failed:
        return None
    first = failed[0]
    why = f"{len(failed)} of {len(verdicts)} completions got no verdict ({first.failure}): " \
          f"{first.reason or first.details.get('error', '')}"
    kinds: dict[str, type[JobError]] = {"invalid_task": InvalidTask, "checker_error": VerifyError,
                                        "timeout": CheckTimeout}
    return kinds.get(first.failure or "", SandboxError)(why[:2000])
