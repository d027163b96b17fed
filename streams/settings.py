"""Process settings, read once from the environment (prefix ``KILN_``).

Defaults are the embedded single-machine setup that ``infra/`` starts: Kafka on 127.0.0.1:9092,
blobs on the local filesystem under the cache directory.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

KAFKA_LOGGER = "kiln.librdkafka"
"""The Python logger every Kafka client kiln makes writes librdkafka's own log lines to."""


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln"


class Cluster(BaseModel):
    """One Kafka cluster a client may use (``KILN_CLUSTERS``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    bootstrap_servers: str = Field(min_length=1)
    kafka_config: dict[str, str | int | bool] = Field(default_factory=dict, description="Added to KILN_KAFKA_CONFIG.")
    draining: bool = Field(False, description="Take no new requests; keep reading results until in-flight ones are "
                                              "in.")


class KilnSettings(BaseSettings):
    """Every knob a kiln process reads. Environment variable = ``KILN_`` + upper-case field name."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    bootstrap_servers: str = Field("127.0.0.1:9092", description="Kafka/Redpanda bootstrap servers.")
    kafka_config: dict[str, str | int | bool] = Field(
        default_factory=dict, description="librdkafka settings added to every Kafka client kiln makes (JSON): "
        "security.protocol, sasl.mechanism, sasl.username, sasl.password, ssl.ca.location, ...")
    clusters: list[Cluster] = Field(default_factory=list, description="Ordered clusters for ClusterClient (JSON "
                                    "list): new requests go to the first not draining, results are read from all. "
                                    "Empty: the one at bootstrap_servers.")
    topic_prefix: str = Field("", description="Prefix for every topic name, to share one cluster.")
    topic_replication: int | None = Field(None, ge=1, description="Replication of the topics kiln creates; unset: "
                                          "the cluster's default.replication.factor (else min(3, brokers)).")
    topic_min_insync_replicas: int | None = Field(None, ge=1, description="min.insync.replicas of the topics kiln "
                                                  "creates; unset: the cluster's (else min(2, replication)).")
    allow_unsafe_topics: bool = Field(False, description="Create topics that can lose an acknowledged write on a "
                                      "multi-broker cluster (replication 1 or min.insync.replicas 1) anyway.")
    cache: Path = Field(default_factory=_default_cache, description="Cache and state directory (outside repo).")
    blob_store: str = Field(
        "", description="'file:///path' or 's3://bucket/prefix'; empty = file store under the cache directory."
    )
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL; unset = AWS default resolution.")
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_region: str = "us-east-1"
    claim_check_bytes: int = Field(256 * 1024, description="Payloads above this size travel as claim checks.")
    metrics_host: str = Field("127.0.0.1", description="Bind address of the metrics/health endpoint.")
    metrics_port: int = Field(0, description="Prometheus/health HTTP port of a worker; 0 = pick a free one.")

    group_protocol: str = Field("auto", pattern="^(auto|consumer|classic)$",
                                description="'consumer' = KIP-848; 'auto' uses it when the broker has it.")
    slots: int = Field(0, ge=0, description="Job slots per worker; 0 = the CPUs available to this process.")
    cpu_fraction: float = Field(1.0, gt=0, le=1, description="With slots 0: the share of this machine's CPUs to "
                                "run jobs on (a GPU node lending its spare CPUs: e.g. 0.25).")
    commit_interval_s: float = Field(0.02, ge=0, le=5, description="How long a worker gathers finished jobs into "
                                     "one offset commit: every commit is a write to the broker's offsets log (in "
                                     "bench/dispatch, 20 ms instead of 5 took the broker from ~67 to ~53 µs of CPU "
                                     "per job); a crash re-runs jobs finished in the last interval too.")
    broker_wait_s: float = Field(300.0, ge=0, description="How long `kiln worker` waits for a broker it cannot "
                                 "reach at start (one started during a broker restart must not exit) before it "
                                 "gives up; other commands fail at once.")
    grace_s: float = Field(30.0, ge=0, description="On SIGTERM or revoke, how long running jobs may finish.")
    queue_topics: list[str] = Field(default_factory=list, description="Request topics consumed in queue mode "
                                    "(share groups); clients send them one record per batch. JSON list.")
    heartbeat_s: float = Field(5.0, gt=0, le=300, description="How often a worker publishes its heartbeat "
                               "(slots, busy, state) to kiln.heartbeats.")
    job_timeout_s: float | None = Field(None, gt=0, description="Per-attempt time limit; overrides the stage's own.")
    lanes: dict[str, int] = Field(default_factory=dict, description="Slot budgets per lane (the request's ``lane``, "
                                  "e.g. '{\"long\": 6}': long jobs hold at most 6 of a worker's slots, so the "
                                  "rest stay free for short ones). Lanes not named are unlimited. Group mode.")

    readahead_bytes: int = Field(32 << 20, ge=1 << 20, description="Bytes of requests a worker buffers ahead of "
                                 "its running jobs (each record counted with a fixed overhead), shared by its "
                                 "partitions: deep enough to see a light client's job behind a flood. Group mode.")
    offset_metadata_chars: int = Field(3000, ge=16, description="Longest finished-ahead map a worker commits "
                                       "inline (under the broker's offset.metadata.max.bytes, 4096 by default); "
                                       "a longer one is spilled to the blob store and the commit names its digest.")
    client_weights: dict[str, float] = Field(default_factory=dict, description="Fair-queueing weights by client "
                                             "id (JSON, e.g. '{\"eval-7\": 4}': that client gets 4 times the "
                                             "slot time of one with the default weight 1). Group mode.")

    @field_validator("client_weights")
    @classmethod
    def _positive_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        if any(w <= 0 for w in weights.values()):
            raise ValueError("a client's weight is above 0")
        return weights

    @field_validator("lanes")
    @classmethod
    def _positive_lanes(cls, lanes: dict[str, int]) -> dict[str, int]:
        if any(cap < 1 for cap in lanes.values()):
            raise ValueError("a lane's slot budget is at least 1")
        return lanes

    def job_slots(self, per_cpu: float = 1.0) -> int:
        """Slots of a worker not told otherwise: ``slots``, else the CPUs available times ``cpu_fraction`` times
        what the stage runs per CPU (``Stage.slots_per_cpu``)."""
        return self.slots or max(1, int(len(os.sched_getaffinity(0)) * self.cpu_fraction * per_cpu))

    def topic(self, name: str) -> str:
        return f"{self.topic_prefix}{name}"

    def kafka(self, **kiln: Any) -> dict[str, Any]:
        """A client configuration: the servers, librdkafka's log lines into the Python logger ``kiln.librdkafka``
        (never printed by librdkafka itself; the ``kiln`` command sends them to its log file), the deployment's own
        settings (security), then kiln's (which keep its guarantees, so they win)."""
        return {"bootstrap.servers": self.bootstrap_servers, "logger": logging.getLogger(KAFKA_LOGGER),
                **self.kafka_config, **kiln}


def producer_config(settings: KilnSettings, **extra: Any) -> dict[str, Any]:
    """A producer's configuration (a worker's, a client's, the trainer service's): idempotent, so retries never
    duplicate or reorder a partition's records."""
    return settings.kafka(**{"enable.idempotence": True, "acks": "all", "linger.ms": 2, "compression.type": "zstd",
                             "message.timeout.ms": 120000, **extra})


@lru_cache(maxsize=1)
def get_settings() -> KilnSettings:
    """The one settings object of this process."""
    return KilnSettings()


def _callers_level() -> int:
    """The ``stacklevel`` of the code that made the settings object, past pydantic's frames and this module's."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(("pydantic", __name__)):
        frame, level = frame.f_back, level + 1
    return level


class _RenamedEnv(PydanticBaseSettingsSource):
    """The variables of a settings class under its old prefix, each read (with a warning naming its new name) only
    where the new name is not set."""

    def __init__(self, settings_cls: type[BaseSettings], old_prefix: str) -> None:
        super().__init__(settings_cls)
        self.old_prefix = old_prefix

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads them all

    def __call__(self) -> dict[str, Any]:
        new_prefix = str(self.settings_cls.model_config.get("env_prefix", ""))
        values: dict[str, Any] = {}
        for name in self.settings_cls.model_fields:
            old, new = f"{self.old_prefix}{name}".upper(), f"{new_prefix}{name}".upper()
            if old in os.environ and new not in os.environ:
                message = f"{old} is renamed {new}; the old name is read until the next release"
                warnings.warn(message, DeprecationWarning, stacklevel=_callers_level())
                logging.getLogger(__name__).warning(message)
                values[name] = os.environ[old]
        return values


class RenamedPrefix(BaseSettings):
    """Settings whose prefix was renamed: a subclass sets ``renamed_from`` to the old prefix, and a variable under it
    is still read for one release where the new name is not set, with a ``DeprecationWarning`` naming the new one.
    Values are read as the new variables would be (simple types; JSON for lists and dicts is not decoded)."""

    renamed_from: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        renamed = (_RenamedEnv(settings_cls, cls.renamed_from),) if cls.renamed_from else ()
        return init_settings, env_settings, *renamed, dotenv_settings, file_secret_settings
