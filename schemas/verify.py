"""Models of the ``verify`` stage: a task and a batch of completions in, one verdict per completion out."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.schemas.rl import RolloutTask

FailureKind = Literal["timeout", "sandbox_error", "invalid_task", "checker_error", "unavailable"]
"""kiln's side of a check that gave no verdict: the check itself ran past its time (``timeout``: the task's checker
as a whole, never the completion's program), the sandbox could not run it, the task cannot be checked as given, the
checker failed, or the request got no answer. A verdict with one carries no reward."""
PolicyFailure = Literal["timeout", "crashed", "memory", "output_limit"]
"""The completion's own failure, measured outside it: its program (or proof) ran past its limit, ended with a
nonzero exit or a signal, outgrew its memory bound, or flooded its output past the cap. A real verdict: reward 0."""


MAX_COMPLETIONS = 4096
"""Completions one request carries at most (its groups' together, in a step's request)."""
Completions = Annotated[list[str], Field(min_length=1, max_length=MAX_COMPLETIONS)]


class SentTogether(BaseModel):
    """Requests a client sent at once (a training step's groups, in requests of one task each or in several step
    requests): ``id`` theirs, ``requests`` how many groups they carry in all (a request of one task counts one). A
    worker's exec batches wait for the rest of them (within ``KILN_VERIFY_EXEC_BATCH_WINDOW_S``) instead of sending
    the first to arrive alone. A hint about timing only: no verdict depends on it."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64)
    requests: int = Field(ge=1, le=1_000_000)


class VerifyGroup(BaseModel):
    """One task and the completions checked against it (a prompt's group), in a step's request."""

    model_config = ConfigDict(extra="forbid")

    task: RolloutTask
    completions: Completions


class VerifyRequest(BaseModel):
    """One task and its completions, or a training step's groups in one request (one message to the stage and one
    result back instead of one per group). ``task`` says what the verifier needs (``verifier`` names it, ``check`` is
    what it reads: an exec checker, a repository's image and test patch, a Lean statement, an expected ``answer``);
    every completion is checked against it. ``groups`` (instead of ``task`` and ``completions``): several such, each
    judged as a request of its own would be, their verdicts in one result in the groups' order.
    ``sent_together``: the requests it was sent with, if any."""

    model_config = ConfigDict(extra="forbid")

    task: RolloutTask | None = None
    completions: Completions | None = None
    groups: Annotated[list[VerifyGroup], Field(min_length=1, max_length=MAX_COMPLETIONS)] | None = None
    sent_together: SentTogether | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> VerifyRequest:
        if self.groups is None:
            if self.task is None or self.completions is None:
                raise ValueError("a request carries a task and its completions, or groups")
        elif self.task is not None or self.completions is not None:
            raise ValueError("a request carries either a task and its completions or groups, not both")
        elif sum(len(g.completions) for g in self.groups) > MAX_COMPLETIONS:
            raise ValueError(f"a request's groups carry more than {MAX_COMPLETIONS} completions")
        return self

    def each(self) -> list[VerifyGroup]:
        """The request's groups, in order: its one task and completions, or its ``groups``."""
        if self.groups is not None:
            return self.groups
        assert self.task is not None and self.completions is not None  # (_one_shape)
        return [VerifyGroup(task=self.task, completions=self.completions)]


class CompletionVerdict(BaseModel):
    """One completion's verdict. Two kinds of failure, never confused:

    - ``policy_failure``: the completion failed by itself (its program timed out, crashed, ran out of memory,
      flooded its output; or it printed the wrong thing, which needs no name): a real verdict, ``reward`` 0.
    - ``failure``: kiln failed to judge it (sandbox, worker, checker, stage): no real verdict and **no reward**
      (``reward`` is 0 on the wire and means nothing; ``reason`` says why). kiln retried it within its budget
      first (``attempts``); each trainer adapter hands it to its trainer as that trainer's own "no reward"."""

    model_config = ConfigDict(extra="forbid")

    reward: float
    failure: FailureKind | None = Field(None, description="kiln's failure: no real verdict, no reward")
    policy_failure: PolicyFailure | None = Field(None, description="the completion's own failure: a real "
                                                                   "verdict of 0")
    attempts: int = Field(1, ge=1, description="checks this verdict took (more than 1: kiln's failures retried)")
    reason: str = ""
    passed: int | None = Field(None, description="tests passed, when the verifier counts them")
    failed: int | None = Field(None, description="tests failed, when the verifier counts them")
    details: dict[str, Any] = Field(default_factory=dict)
    seconds: float = Field(0.0, description="from the request's start in the worker to this verdict")
    verifier: str = Field("", max_length=64, description="the verifier that decided it (the task's ``verifier``); "
                                                          "empty in verdicts stored before it was carried")
    version: str = Field("", max_length=64, description="digest of the verifier's source, the task's check and the "
                                                         "images it names (``kiln.workers.verifiers.version``); empty "
                                                         "when no verifier was found, or stored before it was carried")


def scored(verdict: CompletionVerdict) -> float | None:
    """The verdict's reward, or None when it has none (kiln's failure): what every trainer adapter starts from."""
    return None if verdict.failure else verdict.reward


class GroupVerdicts(BaseModel):
    """Where a group's verdicts are in a step's result: its task, and ``count`` verdicts (the result's next ones, after
    those of the groups before it)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    verifier: str
    count: int = Field(ge=0)


class VerifyResult(BaseModel):
    """One verdict per completion, in the request's order (a step's: group after group). ``task_id`` and ``verifier``
    are the task's; for a step's request ``task_id`` is empty, ``verifier`` its groups' verifiers (sorted, joined
    by ``+``), and ``groups`` says whose verdicts are where."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    verifier: str
    verdicts: list[CompletionVerdict]
    verify_s: float = Field(description="the worker's time on the whole batch")
    groups: list[GroupVerdicts] | None = Field(None, description="a step's request: its groups, in order")

    def by_group(self) -> list[list[CompletionVerdict]]:
        """The verdicts of each of the request's groups, in order (one list for a request of one task)."""
        if self.groups is None:
            return [self.verdicts]
        out, at = [], 0
        for group in self.groups:
            out.append(self.verdicts[at:at + group.count])
            at += group.count
        return out


class RescoredRequest(BaseModel):
    """One stored verify request re-scored by ``kiln verify rescore``: its verdicts now (``result``) next to those it
    was answered with (``before``, from the results topic; None when no result is kept), on ``verify.rescored``."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    topic: str
    partition: int
    offset: int
    before: VerifyResult | None
    result: VerifyResult
    changed: list[int] = Field(default_factory=list, description="indices of completions whose reward or failure "
                                                                  "differs from ``before``")
