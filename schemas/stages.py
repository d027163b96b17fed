"""Which topic and models belong to each stage kind. Shared by the client (to route) and workers (to decode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.builtin import EchoRequest, EchoResult, SleepRequest, SleepResult
from kiln.schemas.exec import ExecRequest, ExecResult
from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.schemas.lean import LeanRequest, LeanResult


@dataclass(frozen=True)
class StageSpec:
    kind: str
    request_topic: str
    request_model: type[BaseModel]
    result_model: type[BaseModel]
    ordering: Literal["unordered", "keyed"] = "unordered"
    events_topic: str | None = None
    """Where every successful result is also published (keyed like its request), for readers other than the
    requester; never re-published by a replay."""


STAGES: dict[str, StageSpec] = {
    "echo": StageSpec("echo", "echo.requests", EchoRequest, EchoResult),
    "sleep": StageSpec("sleep", "sleep.requests", SleepRequest, SleepResult),
    "build": StageSpec("build", "image.build", BuildRequest, BuildEvent, events_topic="image.events"),
    # Keyed by session: one session's requests run in order, different sessions concurrently.
    "exec": StageSpec("exec", "exec.requests", ExecRequest, ExecResult, ordering="keyed"),
    "lean": StageSpec("lean", "lean.requests", LeanRequest, LeanResult),
    # Keyed by the root repository, so a rewrite runs after the ingestion of its source, also in a replay.
    "ingest": StageSpec("ingest", "repo.ingest", IngestRequest, IngestEvent, ordering="keyed",
                        events_topic="repo.events"),
}

DEFAULT_RESULTS_TOPIC = "kiln.results"
