"""Request and result models of the built-in stages ``echo`` and ``sleep``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class EchoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: Any = None


class EchoResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: Any = None


Failure = Literal["none", "transient", "permanent", "crash", "hang"]


class SleepRequest(BaseModel):
    """Occupy a slot for ``seconds``; optionally fail in a chosen way, to exercise the runtime's policies."""

    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(0.0, ge=0, le=24 * 3600)
    mode: Literal["sleep", "spin"] = Field("sleep", description="'spin' burns CPU instead of sleeping.")
    fail: Failure = "none"
    fail_attempts: int = Field(1_000_000, ge=0, description="Fail only the first N attempts, then succeed.")
    tag: str = Field("", max_length=256, description="Free text echoed back; tests use it to trace jobs.")


class SleepResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slept: float
    attempt: int
    tag: str = ""
    worker: str = ""
