"""The faust app: three counting agents (results, dead letters, heartbeats), one timer that assembles and
publishes ``StageStats`` per stage, and the HTTP pages serving them.

Tables live in memory and are rebuilt from their changelog topics on restart (faust's recovery). Internal topics
have one partition, so one instance holds every table; a second instance is a standby, not a shard.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import faust
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.envelope import ResultEnvelope
from kiln.schemas.ops import StageStats, WorkerHeartbeat
from kiln.streams import admin
from kiln.streams.errors import ConfigError
from kiln.streams.heartbeat import STALE_BEATS
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import (
    HEARTBEATS_TOPIC,
    LEGACY_HEARTBEATS_TOPIC,
    RESULTS_TOPIC,
    STATS_TOPIC,
    StageSpec,
    TopicSpec,
    stage_specs,
)
from kiln.streams.stats import windows
from kiln.streams.stats.queue import queue_length

log = logging.getLogger("kiln.stats")


class StatsSettings(BaseSettings):
    """The stats app's own knobs (``KILN_STATS_`` + field name); Kafka and topics come from ``KilnSettings``."""

    model_config = SettingsConfigDict(env_prefix="KILN_STATS_", extra="ignore")

    host: str = Field("127.0.0.1", description="Bind address of the HTTP pages.")
    port: int = Field(8600, description="HTTP port: /stats, /stats/<stage>, /workers, /healthz, /metrics.")
    publish_s: float = Field(5.0, gt=0, description="How often per-stage numbers are computed and published.")
    result_topics: list[str] = Field(default_factory=lambda: [RESULTS_TOPIC],
                                     description="Topics results are read from (unprefixed; JSON list).")
    forget_after_s: float = Field(600.0, gt=0, description="A worker silent this long gets a tombstone on "
                                                           "kiln.heartbeats (it was killed without saying so).")


def _credentials(settings: KilnSettings) -> dict[str, Any]:
    """The deployment's Kafka security settings, as faust (aiokafka) takes them."""
    conf = settings.kafka_config
    protocol = str(conf.get("security.protocol", "PLAINTEXT")).upper()
    if protocol == "PLAINTEXT":
        return {}
    if protocol == "SASL_PLAINTEXT" and "sasl.username" in conf:
        return {"broker_credentials": faust.SASLCredentials(
            username=str(conf["sasl.username"]), password=str(conf.get("sasl.password", "")),
            mechanism=str(conf.get("sasl.mechanism", "PLAIN")))}
    raise ConfigError(f"the stats app supports PLAINTEXT and SASL_PLAINTEXT brokers, not {protocol}")


class StatsApp:
    """``StatsApp(settings, stats).app`` is the faust app; ``snapshot()`` is what was published last."""

    def __init__(self, settings: KilnSettings, stats: StatsSettings) -> None:
        self.settings = settings
        self.stats = stats
        self.latest: dict[str, StageStats] = {}
        self._admin: AdminClient | None = None
        prefix = settings.topic_prefix
        (settings.cache / "stats").mkdir(parents=True, exist_ok=True)
        self.app = faust.App(
            f"{prefix}kiln-stats", broker=[f"kafka://{s.strip()}" for s in settings.bootstrap_servers.split(",")],
            store="memory://", web_host=stats.host, web_port=stats.port, web_bind=stats.host,
            topic_partitions=1, topic_replication_factor=1, datadir=str(settings.cache / "stats"),
            consumer_auto_offset_reset="earliest", web_enabled=True, **_credentials(settings))
        results = self._raw_topic(*[settings.topic(t) for t in stats.result_topics])
        existing = AdminClient(settings.kafka()).list_topics(timeout=30).topics
        self.heartbeats = self._raw_topic(settings.topic(HEARTBEATS_TOPIC))  # where tombstones go
        # Heartbeats are read from the legacy topic too while it exists (workers of the release before).
        legacy = settings.topic(LEGACY_HEARTBEATS_TOPIC)
        beats = self._raw_topic(settings.topic(HEARTBEATS_TOPIC), *([legacy] if legacy in existing else []))
        self.out = self._raw_topic(settings.topic(STATS_TOPIC))
        # Faust co-partitions a table with the stream that writes it: the sources (results: 16 partitions, the rest:
        # 1) are first turned into counting events on one internal topic keyed by stage, and only its agent writes.
        self.events = self.app.topic(f"{prefix}kiln-stats-events", internal=True, key_serializer="raw",
                                     value_serializer="json")
        self.counts = self.app.Table("counts", default=None)
        self.totals = self.app.Table("totals", default=int)
        self.last = self.app.Table("last", default=None)
        self.workers = self.app.Table("workers", default=None)
        self.consumers = self.app.Table("consumers", default=None)
        self._stage_of_worker: dict[str, str] = {}
        self.app.agent(results, name="results")(self._from_results)
        if dead_letter_topics := self._dead_letter_topics(existing):
            self.app.agent(self._raw_topic(*dead_letter_topics), name="dead-letters")(self._from_dead_letters)
        self.app.agent(beats, name="heartbeats")(self._from_heartbeats)
        self.app.agent(self.events, name="count")(self._count)
        self.app.timer(stats.publish_s, on_leader=True, name="publish")(self._publish)
        self._pages()

    def declare_topics(self, timeout: float = 60.0) -> None:
        """Faust's internal topics (the events topic, the tables' changelogs, the leader assignor's), created before
        the app's consumer joins and waited for until the cluster's metadata lists them. Left to faust, they are
        created just before the join: on a loaded machine the join's metadata missed them, faust assigned no
        partition at all, and the app counted nothing until its next metadata refresh (minutes). Created through
        kiln's admin, they are replicated as the deployment's other topics."""
        prefix = self.settings.topic_prefix
        unprefixed = [name.removeprefix(prefix) for name in (
            self.events.get_topic_name(), f"{self.app.conf.id}-__assignor-__leader")]
        specs = [TopicSpec(name, 1) for name in unprefixed]
        specs += [TopicSpec(table.changelog_topic.get_topic_name().removeprefix(prefix), 1,
                            {"cleanup.policy": "compact"}) for table in self.app.tables.values()]
        admin.create_topics(self.settings, specs, timeout)  # returns once each has a leader in the metadata

    def _raw_topic(self, *names: str) -> Any:
        return self.app.topic(*names, key_serializer="raw", value_serializer="raw")

    def _dead_letter_topics(self, names: Iterable[str]) -> list[str]:
        """Every dead-letter topic under this deployment's prefix that exists when the app starts (faust's pattern
        subscription does not combine with named topics; a topic created later is read after a restart)."""
        prefix = self.settings.topic_prefix
        return sorted(n for n in names if n.startswith(prefix) and n.endswith(".dlq"))

    # ---- agents: turning records into counting events, counting -------------------------------------------

    async def _emit(self, stage: str, event: dict[str, Any]) -> None:
        await self.events.send(key=stage.encode(), value={"stage": stage, **event})

    async def _from_results(self, stream: Any) -> None:
        specs = stage_specs()
        async for value in stream:
            try:
                result = ResultEnvelope.model_validate_json(value)
            except ValidationError:
                continue  # not a result: nothing to count
            add: dict[str, float] = {"done": 1}
            total: dict[str, float] = {"done": 1}
            if result.status == "error":
                reason = f"fail:{result.error.type if result.error else 'unknown'}"
                add[reason] = total[reason] = 1
            if result.started_at is not None:
                add[f"lat:{latency_bucket((result.finished_at - result.started_at).total_seconds())}"] = 1
            last = _facets(specs.get(result.kind), result, add, total)
            await self._emit(result.kind, {"t": result.finished_at.timestamp(), "add": add, "total": total,
                                           "last": last})

    async def _from_dead_letters(self, stream: Any) -> None:
        async for event in stream.events():
            stage = dict(event.message.headers or []).get("kiln-stage")
            if stage:
                name = stage.decode(errors="replace") if isinstance(stage, bytes) else str(stage)
                await self._emit(name, {"t": event.message.timestamp, "add": {"dlq": 1}, "total": {"dlq": 1}})

    async def _from_heartbeats(self, stream: Any) -> None:
        async for event in stream.events():
            worker = event.key.decode(errors="replace") if isinstance(event.key, bytes) else str(event.key)
            if event.value is None:
                await self._emit(self._stage_of_worker.pop(worker, ""), {"gone": worker})
                continue
            try:
                beat = WorkerHeartbeat.model_validate_json(event.value)
            except ValidationError:
                continue
            self._stage_of_worker[beat.worker] = beat.stage
            await self._emit(beat.stage, {"t": beat.at, "beat": beat.model_dump(mode="json"), "add": {
                "worker_s": beat.interval_s, "slot_s": beat.slots * beat.interval_s,
                "busy_s": beat.busy * beat.interval_s}})

    async def _count(self, stream: Any) -> None:
        async for event in stream:
            stage = event["stage"]
            for metric, amount in event.get("add", {}).items():
                windows.add(self.counts, stage, metric, event["t"], amount)
            for metric, amount in event.get("total", {}).items():
                self.totals[windows.SEP.join((stage, metric))] += amount
            for name, value in event.get("last", {}).items():
                key = windows.SEP.join((stage, name))
                newest = self.last.get(key)
                if newest is None or newest[0] <= event["t"]:
                    self.last[key] = [event["t"], value]
            if "gone" in event:
                self.workers.pop(event["gone"], None)
            if beat := event.get("beat"):
                self.workers[beat["worker"]] = beat
                self.consumers[windows.SEP.join((stage, beat["topic"], beat["group"]))] = beat["mode"]

    # ---- the timer: assemble, publish ---------------------------------------------------------------------

    def _consumer_groups(self) -> dict[str, set[tuple[str, str]]]:
        """(topic, group) pairs per stage: those its workers' heartbeats ever named; a stage no worker has announced
        yet is measured on its default topic and group (``kiln worker``'s defaults)."""
        announced: dict[str, set[tuple[str, str]]] = {}
        for key, mode in list(self.consumers.items()):
            stage, topic, group = key.split(windows.SEP)
            if mode == "group":
                announced.setdefault(stage, set()).add((topic, group))
        defaults = {kind: {(self.settings.topic(spec.request_topic), f"kiln.{kind}")}
                    for kind, spec in stage_specs().items()}
        return {**defaults, **announced}

    def _queue_lengths(self, pairs: dict[str, set[tuple[str, str]]]) -> dict[str, int | None]:
        if self._admin is None:
            self._admin = AdminClient(self.settings.kafka())
        lengths: dict[str, int | None] = {}
        for stage, combos in pairs.items():
            found = [queue_length(self._admin, topic, group) for topic, group in sorted(combos)]
            known = [n for n in found if n is not None]
            lengths[stage] = sum(known) if known else None
        return lengths

    def compute(self, now: float, lengths: dict[str, int | None]) -> dict[str, StageStats]:
        """Every stage's numbers at ``now`` from the tables (read only) and the queue lengths."""
        live = [WorkerHeartbeat.model_validate(b) for b in list(self.workers.values()) if b is not None]
        live = [b for b in live if b.at >= now - STALE_BEATS * b.interval_s]
        keys = list(self.counts.keys())
        totals = {tuple(k.split(windows.SEP)): int(v) for k, v in list(self.totals.items()) if windows.SEP in k}
        stages = set(lengths) | {b.stage for b in live} | {k.split(windows.SEP)[0] for k in keys}
        out = {}
        for stage in sorted(stages):
            def per_min(metric: str, stage: str = stage) -> float:
                return windows.last_minute(self.counts.get, stage, metric, now) * 60 / windows.WINDOW_S

            def total(metric: str, stage: str = stage) -> int:
                return totals.get((stage, metric), 0)
            mine = [b for b in live if b.stage == stage]
            failures = {m.removeprefix("fail:"): per_min(m) for m in windows.metrics_of(keys, stage, "fail:")}
            facet_names = windows.metrics_of(keys, stage, "facet:")
            facets: dict[str, dict[str, float]] = {}
            for metric in facet_names:
                name, _, value = metric.removeprefix("facet:").partition("=")
                if rate := per_min(metric):
                    facets.setdefault(name, {})[value] = rate
            facets_total: dict[str, dict[str, int]] = {}
            for (owner, metric), count in totals.items():
                if owner == stage and metric.startswith("facet:"):
                    name, _, value = metric.removeprefix("facet:").partition("=")
                    facets_total.setdefault(name, {})[value] = count
            means = {}
            for metric in windows.metrics_of(keys, stage, "sum:"):
                name = metric.removeprefix("sum:")
                if n := per_min(f"n:{name}"):
                    means[name] = per_min(metric) / n
            last = {k.split(windows.SEP)[1]: v[1] for k, v in list(self.last.items())
                    if v is not None and k.split(windows.SEP)[0] == stage}
            gauges: dict[str, float] = {}
            for beat in mine:
                for name, level in beat.gauges.items():
                    gauges[name] = gauges.get(name, 0.0) + level
            histogram = {int(m.removeprefix("lat:")): per_min(m) for m in windows.metrics_of(keys, stage, "lat:")}
            out[stage] = StageStats(
                stage=stage, at=now, window_s=windows.WINDOW_S, queue_length=lengths.get(stage),
                completions_per_min=per_min("done"), failures_per_min={k: v for k, v in failures.items() if v},
                dead_letters_per_min=per_min("dlq"), workers_avg=per_min("worker_s") / 60,
                slots_avg=per_min("slot_s") / 60, busy_avg=per_min("busy_s") / 60, workers_now=len(mine),
                slots_now=sum(b.slots for b in mine), busy_now=sum(b.busy for b in mine),
                completions_total=total("done"),
                failures_total={m.removeprefix("fail:"): n for (o, m), n in totals.items()
                                if o == stage and m.startswith("fail:")},
                dead_letters_total=total("dlq"), job_seconds_p50=quantile(histogram, 0.5),
                job_seconds_p99=quantile(histogram, 0.99), facets_per_min=facets, facets_total=facets_total,
                values=means, values_last=last, gauges=gauges)
        return out

    async def _publish(self) -> None:
        lengths = await asyncio.to_thread(self._queue_lengths, self._consumer_groups())
        now = time.time()
        self.latest = self.compute(now, lengths)
        for stage, numbers in self.latest.items():
            await self.out.send(key=stage.encode(), value=numbers.model_dump_json().encode())
        await self._forget_silent(now)

    async def _forget_silent(self, now: float) -> None:
        """Tombstones for workers killed without one, so kiln.heartbeats compacts instead of growing forever."""
        for worker, beat in list(self.workers.items()):
            if beat is not None and beat["at"] < now - self.stats.forget_after_s:
                await self.heartbeats.send(key=worker.encode(), value=None)

    # ---- HTTP -------------------------------------------------------------------------------------------------

    def _pages(self) -> None:
        app = self.app

        @app.page("/stats")
        async def all_stages(web: Any, request: Any) -> Any:
            return web.json({stage: s.model_dump(mode="json") for stage, s in self.latest.items()})

        @app.page("/stats/{stage}")
        async def one_stage(web: Any, request: Any, stage: str) -> Any:
            if stage not in self.latest:
                return web.json({"error": f"no numbers for stage {stage!r}"}, status=404)
            return web.json(self.latest[stage].model_dump(mode="json"))

        @app.page("/workers")
        async def workers(web: Any, request: Any) -> Any:
            return web.json({k: v for k, v in list(self.workers.items()) if v is not None})

        @app.page("/healthz")
        async def health(web: Any, request: Any) -> Any:
            ready = bool(self.latest) or time.time() - self._started < 60
            return web.json({"status": "ok" if ready else "starting", "stages": len(self.latest)},
                            status=200 if ready else 503)

        @app.page("/metrics")
        async def metrics(web: Any, request: Any) -> Any:
            return web.bytes(self.render_metrics(), content_type=CONTENT_TYPE_LATEST.split(";")[0])

        self._started = time.time()

    def render_metrics(self) -> bytes:
        """The published numbers as Prometheus gauges (``kiln_stats_*``, label ``stage``); what the rules in
        ``infra/prometheus/rules.yml`` and the Grafana dashboard read."""
        registry = CollectorRegistry()
        fields = {"queue_length": "Unfinished records (broker offsets).",
                  "completions_per_min": "Results per minute.", "dead_letters_per_min": "Dead letters per minute.",
                  "workers_avg": "Workers alive, minute average.", "slots_avg": "Slots, minute average.",
                  "busy_avg": "Busy slots, minute average.", "workers_now": "Workers with a fresh heartbeat.",
                  "slots_now": "Slots of the workers alive.", "busy_now": "Busy slots of the workers alive.",
                  "completions_total": "Results since the tables began.",
                  "dead_letters_total": "Dead letters since the stage's DLQ began.",
                  "job_seconds_p50": "Median job time over the last minute (bucket bound).",
                  "job_seconds_p99": "99th percentile job time over the last minute (bucket bound)."}
        gauges = {name: Gauge(f"kiln_stats_{name}", doc, ["stage"], registry=registry) for name, doc in fields.items()}
        labelled = {
            "failures_per_min": Gauge("kiln_stats_failures_per_min", "Error results per minute by reason.",
                                      ["stage", "reason"], registry=registry),
            "facets_per_min": Gauge("kiln_stats_facet_per_min", "Results per minute by facet value.",
                                    ["stage", "facet", "value"], registry=registry),
            "values": Gauge("kiln_stats_value", "Numeric facets averaged over the last minute.", ["stage", "name"],
                            registry=registry),
            "gauges": Gauge("kiln_stats_worker_gauge", "Workers' own gauges summed per stage.", ["stage", "name"],
                            registry=registry)}
        for stage, numbers in self.latest.items():
            for name, gauge in gauges.items():
                value = getattr(numbers, name)
                if value is not None:
                    gauge.labels(stage=stage).set(value)
            for reason, rate in numbers.failures_per_min.items():
                labelled["failures_per_min"].labels(stage=stage, reason=reason).set(rate)
            for facet, rates in numbers.facets_per_min.items():
                for value, rate in rates.items():
                    labelled["facets_per_min"].labels(stage=stage, facet=facet, value=value).set(rate)
            for name, mean in numbers.values.items():
                labelled["values"].labels(stage=stage, name=name).set(mean)
            for name, level in numbers.gauges.items():
                labelled["gauges"].labels(stage=stage, name=name).set(level)
        return generate_latest(registry)

LATENCY_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                  1800.0, 3600.0, math.inf)
"""Upper bounds (seconds) of the job-time histogram the percentiles are read from."""


def latency_bucket(seconds: float) -> int:
    return next(i for i, bound in enumerate(LATENCY_BOUNDS) if seconds <= bound)


def quantile(histogram: dict[int, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (the last finite bound for the overflow bucket)."""
    count = sum(histogram.values())
    if count <= 0:
        return None
    seen = 0.0
    for index in sorted(histogram):
        seen += histogram[index]
        if seen >= q * count:
            return LATENCY_BOUNDS[min(index, len(LATENCY_BOUNDS) - 2)]
    return LATENCY_BOUNDS[-2]


def _facets(spec: StageSpec | None, result: ResultEnvelope, add: dict[str, float],
            total: dict[str, float]) -> dict[str, float]:
    """Adds the stage's facets of an ok result to the counting event; returns its numeric facets (the newest)."""
    if spec is None or spec.facets is None or result.status != "ok" or result.result is None:
        return {}  # claim-checked results are not fetched: counting must not read the blob store
    try:
        facets = spec.facets(spec.result_model.model_validate(result.result))
    except Exception as e:  # a stage's facet function must not stop the counting of every stage
        log.warning("facets of a %s result failed: %r", result.kind, e)
        return {}
    numbers: dict[str, float] = {}
    for name, value in facets.items():
        if isinstance(value, str):
            metric = f"facet:{name}={value}".replace(windows.SEP, " ")
            add[metric] = total[metric] = 1
        else:
            add[f"sum:{name}"], add[f"n:{name}"] = float(value), 1
            numbers[name] = float(value)
    return numbers
