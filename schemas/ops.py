"""What operations read: worker heartbeats (``kiln.heartbeats``) and the per-stage numbers of the stats stream
(``kiln.stats``), the autoscaler's and the status page's inputs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WorkerHeartbeat(BaseModel):
    """A worker's state every few seconds, keyed by worker id on the compacted ``kiln.heartbeats`` topic; a tombstone
    under the same key says the worker stopped."""

    model_config = ConfigDict(extra="forbid")

    worker: str = Field(min_length=1, max_length=200)
    stage: str = Field(min_length=1, max_length=64)
    topic: str = Field(min_length=1, max_length=249)
    group: str = Field(min_length=1, max_length=249)
    mode: Literal["group", "queue"] = "group"
    slots: int = Field(ge=0)
    busy: int = Field(ge=0)
    state: Literal["starting", "ok", "stopping", "failed"]
    interval_s: float = Field(gt=0, le=3600, description="Seconds until the next heartbeat of this worker.")
    at: float = Field(description="Unix time of this heartbeat.")
    gauges: dict[str, float] = Field(default_factory=dict, max_length=64,
                                     description="The stage's own levels (e.g. sessions open, REPL processes per "
                                                 "header), summed over a stage's workers by the stats stream.")


class StageStats(BaseModel):
    """One stage's numbers over the last full minute, keyed by stage on the compacted ``kiln.stats`` topic."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    at: float = Field(description="Unix time these numbers were computed.")
    window_s: float = Field(description="Length of the window the per-minute numbers cover.")
    queue_length: int | None = Field(description="Records on the stage's request topics not finished: the log end "
                                                 "minus the group's committed offset minus jobs finished ahead of it "
                                                 "(from the commit metadata). None when the broker did not answer.")
    completions_per_min: float = Field(description="Results with any status, per minute.")
    failures_per_min: dict[str, float] = Field(default_factory=dict, description="Error results per minute by "
                                                                                 "reason (the error's type).")
    dead_letters_per_min: float = 0.0
    workers_avg: float = Field(description="Workers alive, averaged over the window (from heartbeats).")
    slots_avg: float = Field(description="Slots of those workers, averaged over the window.")
    busy_avg: float = Field(description="Busy slots, averaged over the window.")
    workers_now: int = Field(description="Workers whose latest heartbeat is fresh.")
    slots_now: int
    busy_now: int
    completions_total: int = Field(description="Results counted since the stats app's tables began.")
    failures_total: dict[str, int] = Field(default_factory=dict, description="Error results by reason, since the "
                                                                             "tables began.")
    dead_letters_total: int = Field(0, description="Dead letters of the stage since its DLQ began (the stats app "
                                                   "reads DLQ topics from their first record).")
    job_seconds_p50: float | None = Field(None, description="Median time from a job's start to its result over the "
                                                            "last minute: the upper bound of its histogram bucket.")
    job_seconds_p99: float | None = None
    facets_per_min: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="Results per minute by facet value (the stage's ``StageSpec.facets``, "
                                          "e.g. build system -> outcome).")
    facets_total: dict[str, dict[str, int]] = Field(default_factory=dict)
    values: dict[str, float] = Field(default_factory=dict, description="Numeric facets averaged over the last "
                                                                       "minute (e.g. rollout lag in versions).")
    values_last: dict[str, float] = Field(default_factory=dict, description="Numeric facets of the newest result.")
    gauges: dict[str, float] = Field(default_factory=dict, description="Workers' gauges summed over fresh "
                                                                       "heartbeats.")
