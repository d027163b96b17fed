"""Which topic and models belong to each stage kind. Shared by the client (to route) and workers (to decode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from schemas.builtin import EchoRequest, EchoResult, SleepRequest, SleepResult


@dataclass(frozen=True)
class StageSpec:
    kind: str
    request_topic: str
    request_model: type[BaseModel]
    result_model: type[BaseModel]
    ordering: Literal["unordered", "keyed"] = "unordered"


STAGES: dict[str, StageSpec] = {
    "echo": StageSpec("echo", "echo.requests", EchoRequest, EchoResult),
    "sleep": StageSpec("sleep", "sleep.requests", SleepRequest, SleepResult),
}

DEFAULT_RESULTS_TOPIC = "kiln.results"
