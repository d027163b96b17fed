"""What a stage is, and how the runtime finds one without knowing any.

A stage package declares a ``StageSpec`` (its topics, partitions, retention, typed models and where its handler
lives) and registers it under the ``kiln.stages`` entry point group. Everything generic reads the registered specs:
the client routes a request kind to its topic and decodes its result, ``kiln topics create`` creates every stage's
topics, ``kiln worker NAME`` imports the handler the spec names, replay finds the stage of a topic. The runtime
imports no stage module by name; see docs/architecture.md ("Adding a stage").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from kiln.schemas.envelope import RequestEnvelope
from kiln.streams.cancel import CancelToken
from kiln.streams.errors import ConfigError

ENTRY_POINT_GROUP = "kiln.stages"
RESULTS_TOPIC = "kiln.results"
"""Where results go unless a client names another topic: the runtime's own topic, one partition per client id."""
RESULTS_PARTITIONS = 16
REDRIVES_TOPIC = "kiln.redrives"
"""Which dead letters ``kiln dlq redrive`` re-drove (compacted, keyed by DLQ record): a second redrive skips them."""
HEARTBEATS_TOPIC = "kiln.heartbeats"
"""Worker heartbeats (``schemas.ops.WorkerHeartbeat``), compacted: the latest state of each worker, by worker id."""
LEGACY_HEARTBEATS_TOPIC = "kiln.workers"
"""The heartbeat topic's name in earlier releases (it collided with the package ``kiln.workers``). Read, never
written, for one release by the stats app and the status page where it exists, so workers not yet upgraded stay
visible during a rolling upgrade; delete it once every worker publishes to ``kiln.heartbeats`` (docs/operations.md,
"Heartbeats")."""
STATS_TOPIC = "kiln.stats"
"""The stats stream's per-stage numbers (``schemas.ops.StageStats``), compacted: the latest, by stage."""
TASK_HEALTH_TOPIC = "kiln.tasks.health"
"""The health of repository tasks (``schemas.tasks.TaskHealth``, written by ``kiln tasks health``), compacted: the
latest, by task id. Task sources read it to skip quarantined tasks; the status page, to show each source's healthy
share."""

# Kept forever: replaying it from offset 0 rebuilds a derived store; dead letters are evidence until looked at.
FOREVER = {"retention.ms": "-1", "retention.bytes": "-1"}
WEEK = {"retention.ms": str(7 * 24 * 3600 * 1000)}
BROKER_TIME = {"message.timestamp.type": "LogAppendTime"}
"""Request and results topics stamp each record with the broker's clock: a worker measures a request's time budget
from it and a client compares its own clock with it, so no decision compares two producers' clocks."""
# Latest value per key; a tombstone is dropped a day later (the stats app writes them for silent workers).
COMPACTED = {"cleanup.policy": "compact", "delete.retention.ms": str(24 * 3600 * 1000), "segment.ms": str(3600 * 1000)}


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Deployment:
    """What a stage's worker pods get unless a deployment's values say otherwise (``kiln k8s render``,
    ``streams/k8s/values.py``): the stage states its own needs, so the runtime names no stage."""

    slots: int = 4
    """Slots per pod; the pod requests this many CPUs."""
    memory_per_slot_mib: int = 1024
    max_workers: int = 100
    container_engine: bool = False
    """Builds or runs containers (build, exec): a rootless engine sidecar and the sandbox node pool."""
    spare_cpu: bool = False
    """Also runs on GPU machines' spare CPUs (a DaemonSet on nodes labelled for it; Lean)."""


@dataclass(frozen=True)
class StageSpec:
    """A stage's contract with the runtime and with clients; cheap to import (models only, no handler)."""

    kind: str
    request_topic: str
    request_model: type[BaseModel]
    result_model: type[BaseModel]
    handler: str
    """``module:attribute`` of the stage's ``Stage`` object; imported only by workers and replay."""
    ordering: Literal["unordered", "keyed"] = "unordered"
    partitions: int = 8
    retention: Literal["week", "forever"] = "week"
    """Of the request topic: ``forever`` for topics replayed to rebuild a store."""
    events_topic: str | None = None
    """Where every successful result is also published (keyed like its request), for readers other than the
    requester; never re-published by a replay."""
    events_partitions: int = 4
    facets: Callable[[Any], dict[str, str | float]] | None = None
    """What the stats stream counts of a successful result (called with the typed result): a string value is
    counted per value (e.g. build system, outcome), a number is averaged (e.g. rollout lag). Keep it cheap and
    of low cardinality: every distinct string value is a table key."""
    deployment: Deployment = Deployment()
    """Its pods' defaults in a Kubernetes deployment (a values file overrides them per stage)."""
    extra_topics: tuple[TopicSpec, ...] = ()
    """Topics the stage's tools write besides its own (e.g. ``verify.rescored``), created with them."""

    def topics(self) -> list[TopicSpec]:
        """The request topic, its dead-letter twin, the events topic and the extra topics, with partitions and
        retention."""
        specs = [TopicSpec(self.request_topic, self.partitions,
                           {**(FOREVER if self.retention == "forever" else WEEK), **BROKER_TIME}),
                 TopicSpec(f"{self.request_topic}.dlq", 1, FOREVER)]
        if self.events_topic:
            specs.append(TopicSpec(self.events_topic, self.events_partitions, WEEK))
        return specs + list(self.extra_topics)


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
    cancel: CancelToken = field(default_factory=CancelToken)
    """This attempt's cancellation: blocking work runs through ``cancel.run`` (see ``streams/cancel.py``)."""
    expires_at: float | None = None
    """When the request's time budget runs out, on this worker's clock (``time.time()``): its deadline minus its
    ``created_at`` (both the client's clock) measured from the broker's timestamp of the record (a topic with
    ``message.timestamp.type=LogAppendTime``). None: the envelope's absolute deadline decides."""


Handler = Callable[[Any, JobContext], Awaitable[BaseModel]]
Setup = Callable[[int], Awaitable[None]]
Teardown = Callable[[], Awaitable[None]]
Revoke = Callable[[list[int]], Awaitable[None]]


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
    on_revoke: Revoke | None = None
    """Called with the partitions leaving this worker (a rebalance, or shutdown) once their jobs have finished or
    been given up, before they are released: e.g. to hand state kept per partition over to the next owner."""
    gauges: Callable[[], dict[str, float]] | None = None
    """Levels this worker reports in every heartbeat (e.g. sessions open); the stats stream sums them per stage."""
    slots_per_cpu: float = 1.0
    """Jobs per CPU when the worker is not told its slots: a stage whose jobs mostly wait on something else (a
    sandbox that has CPUs of its own, a remote server) runs several per CPU."""

    @property
    def name(self) -> str:
        return self.spec.kind


def stage_specs() -> dict[str, StageSpec]:
    """Every registered stage's spec by kind (entry point group ``kiln.stages``), read anew on each call."""
    specs: dict[str, StageSpec] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        spec = ep.load()
        if not isinstance(spec, StageSpec):
            raise ConfigError(f"entry point {ep.name!r} ({ep.value}) is {type(spec).__name__}, not a StageSpec")
        if spec.kind != ep.name:
            raise ConfigError(f"entry point {ep.name!r} declares a spec of kind {spec.kind!r}")
        specs[spec.kind] = spec
    return specs


def stage_spec(kind: str) -> StageSpec:
    specs = stage_specs()
    if kind not in specs:
        raise ConfigError(f"no stage named {kind!r}; installed: {', '.join(sorted(specs)) or 'none'}")
    return specs[kind]


def spec_for_topic(topic: str) -> StageSpec | None:
    """The stage whose request topic (unprefixed) is ``topic``."""
    return next((s for s in stage_specs().values() if s.request_topic == topic), None)


def topology(specs: dict[str, StageSpec] | None = None) -> list[TopicSpec]:
    """Every topic kiln needs: the runtime's results, heartbeat, stats, redrive and task-health topics plus each
    registered stage's topics."""
    topics = [TopicSpec(RESULTS_TOPIC, RESULTS_PARTITIONS, {**WEEK, **BROKER_TIME}),
              TopicSpec(HEARTBEATS_TOPIC, 1, COMPACTED), TopicSpec(STATS_TOPIC, 1, COMPACTED),
              TopicSpec(REDRIVES_TOPIC, 1, COMPACTED), TopicSpec(TASK_HEALTH_TOPIC, 1, COMPACTED)]
    for spec in (specs if specs is not None else stage_specs()).values():
        topics.extend(spec.topics())
    return topics


def load_stage(name: str) -> Stage:
    """The stage registered under ``name``: its spec, then the handler object the spec names."""
    spec = stage_spec(name)
    module, _, attribute = spec.handler.partition(":")
    try:
        stage = getattr(import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"stage {name!r}: cannot load its handler {spec.handler!r}: {e}") from e
    if not isinstance(stage, Stage):
        raise ConfigError(f"stage {name!r}: {spec.handler} is {type(stage).__name__}, not a Stage")
    if stage.spec != spec:
        raise ConfigError(f"stage {name!r}: {spec.handler} serves kind {stage.spec.kind!r} with another spec")
    return stage
