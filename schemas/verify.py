"""Models of the ``verify`` stage: a task and a batch of completions in, one verdict per completion out."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.rl import RolloutTask

FailureKind = Literal["timeout", "sandbox_error", "invalid_task", "checker_error", "unavailable"]


class VerifyRequest(BaseModel):
    """``task`` says what the verifier needs (``verifier`` names it, ``check`` is what it reads: an exec checker, a
    repository's image and test patch, a Lean statement, an expected ``answer``); every completion is checked
    against it."""

    model_config = ConfigDict(extra="forbid")

    task: RolloutTask
    completions: list[str] = Field(min_length=1, max_length=4096)


class CompletionVerdict(BaseModel):
    """One completion's verdict. ``failure`` set: it has no real verdict (``reason`` says why) and ``reward`` is 0
    — a trainer scores it 0 and goes on, nothing is raised."""

    model_config = ConfigDict(extra="forbid")

    reward: float
    failure: FailureKind | None = None
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


class VerifyResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str
    verifier: str
    verdicts: list[CompletionVerdict]
    verify_s: float = Field(description="the worker's time on the whole batch")


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
