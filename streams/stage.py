"""What a stage is: a typed handler plus its policies, registered by name through the ``kiln.stages`` entry point.

The runtime never imports a stage module: ``load_stage("echo")`` resolves the entry point a package declares.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from kiln.schemas.envelope import RequestEnvelope
from kiln.schemas.stages import StageSpec
from kiln.streams.errors import ConfigError


@dataclass
class JobContext:
    """What a handler may know about the job besides its typed request."""

    envelope: RequestEnvelope
    attempt: int
    worker_id: str
    topic: str
    partition: int
    offset: int
    replay: bool = False
    key: str | None = None
    """The request record's key (e.g. where follow-up requests should be routed)."""


Handler = Callable[[Any, JobContext], Awaitable[BaseModel]]
Setup = Callable[[int], Awaitable[None]]
Teardown = Callable[[], Awaitable[None]]


@dataclass
class Stage:
    """A handler and the policies the runtime applies around it."""

    spec: StageSpec
    handler: Handler
    job_timeout_s: float | None = None
    max_attempts: int = 3
    registry: CollectorRegistry | None = None
    """The stage's own Prometheus metrics, served on the worker's /metrics next to the runtime's."""
    setup: Setup | None = None
    """Called with the worker's slot count before the first job (e.g. to size and prewarm a process pool)."""
    teardown: Teardown | None = None
    """Called after the last job has finished, on shutdown."""

    @property
    def name(self) -> str:
        return self.spec.kind


ENTRY_POINT_GROUP = "kiln.stages"


def available_stages() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def load_stage(name: str) -> Stage:
    """The stage registered under ``name`` (entry point group ``kiln.stages``)."""
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        raise ConfigError(f"no stage named {name!r}; installed: {', '.join(available_stages()) or 'none'}")
    stage = matches[0].load()
    if not isinstance(stage, Stage):
        raise ConfigError(f"entry point {name!r} is {type(stage).__name__}, not a Stage")
    return stage
