"""The builder's errors, under kiln's root ``KilnError``. A build's become a failure class in its event, never a
dead letter; the others are the task commands' (``kiln tasks``).

BuildError
├── PlanError    the rules cannot build this checkout (no rule fits, a manifest does not parse, a base image that
│   │            cannot be had): ``no_rule_matched``
│   └── ToolchainUnavailable  the project needs a toolchain version kiln's image lacks and cannot fetch (a newer
│                Go, a Python its requires-python allows, a Gradle distribution): ``toolchain_unavailable``
└── StepFailed   a build step (docker build, dependency install, compile, a revision layer's rebuild) failed;
                 carries the step's log and whether it ran out of time
TaskPatchFailed  a repository task's test or gold patch does not apply to its revision (``kiln tasks validate``)
TaskFileError    a task file line or task id that does not read (``kiln tasks health``, ``release``, ``quarantine``)
"""

from __future__ import annotations

from kiln.schemas.builder import FailureClass
from kiln.streams.errors import KilnError


class BuildError(KilnError):
    """A build could not produce a usable image."""


class PlanError(BuildError):
    """The rules cannot build this checkout; the message says why."""

    failure: FailureClass = "no_rule_matched"


class ToolchainUnavailable(PlanError):
    """The project needs a toolchain kiln's image does not have and cannot fetch; never a stand-in for it."""

    failure: FailureClass = "toolchain_unavailable"


class StepFailed(BuildError):
    """A build step failed; ``log`` is its output."""

    def __init__(self, log: str, timed_out: bool = False) -> None:
        super().__init__(log[-2000:])
        self.log = log
        self.timed_out = timed_out


class TaskPatchFailed(KilnError):
    """A patch of a repository task does not apply to the revision's tree; the message says which and why."""


class TaskFileError(KilnError):
    """A task file (``kiln tasks health``) or task id that kiln cannot read; the message names the line or id."""
