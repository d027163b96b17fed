"""The verifiers' errors. A group's check that fails routinely is a ``VerifyError`` (typed by ``failure``); a stage the
verifier relies on that could not run the check is a ``SandboxError``."""

from __future__ import annotations

from kiln.schemas.verify import FailureKind
from kiln.streams.errors import RoutineJobError, TransientJobError


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
