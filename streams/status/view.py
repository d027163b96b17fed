"""What the status page and ``kiln status`` show, read from the stats stream's ``kiln.stats``, the workers'
``kiln.heartbeats`` and ``kiln tasks health``'s ``kiln.tasks.health`` (all compacted), never by polling workers. A
thread follows the topics from their start, so the retained history of each stage's numbers feeds the sparklines."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from pydantic import BaseModel, ValidationError

from kiln.schemas.ops import StageStats, WorkerHeartbeat
from kiln.schemas.tasks import TaskHealth
from kiln.streams.heartbeat import STALE_BEATS
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import HEARTBEATS_TOPIC, LEGACY_HEARTBEATS_TOPIC, STATS_TOPIC, TASK_HEALTH_TOPIC

HISTORY = 120
"""Samples of each stage's numbers kept for the sparklines (at the stats app's 5 s: ten minutes)."""
TRENDS = ("queue_length", "completions_per_min", "busy_now", "slots_now", "dead_letters_per_min", "job_seconds_p99")


class OpsView:
    """``start()`` follows the topics; ``snapshot()`` is the page's JSON; ``caught_up`` says both topics were read
    to the end they had when the view started."""

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings
        self.stats: dict[str, StageStats] = {}
        self.history: dict[str, deque[dict[str, Any]]] = {}
        self.workers: dict[str, WorkerHeartbeat] = {}
        self.tasks: dict[str, TaskHealth | None] = {}
        """The latest health record per task id (None: one this reader cannot read)."""
        self.caught_up = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer = Consumer(settings.kafka(**{
            "group.id": f"kiln-status-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
            "enable.partition.eof": True}))
        # The legacy heartbeat topic is read too where it exists (start() assigns only topics the broker has).
        on_beat = functools.partial(self._latest, self.workers, WorkerHeartbeat, False)
        on_task = functools.partial(self._latest, self.tasks, TaskHealth, True)
        self._topics: dict[str, Callable[[bytes | None, bytes | None], None]] = {
            settings.topic(STATS_TOPIC): self._on_stats, settings.topic(HEARTBEATS_TOPIC): on_beat,
            settings.topic(LEGACY_HEARTBEATS_TOPIC): on_beat, settings.topic(TASK_HEALTH_TOPIC): on_task}
        self._pending_eof: set[tuple[str, int]] = set()

    def start(self) -> OpsView:
        assignment = []
        for topic in self._topics:
            md = self._consumer.list_topics(topic, timeout=15).topics.get(topic)
            for p in (md.partitions if md is not None and md.error is None else {}):
                assignment.append(TopicPartition(topic, p, OFFSET_BEGINNING))
                self._pending_eof.add((topic, p))
        self._consumer.assign(assignment)
        if not assignment:
            self.caught_up.set()
        self._thread = threading.Thread(target=self._follow, name="kiln-status-view", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with contextlib.suppress(RuntimeError):
            self._consumer.close()

    def _follow(self) -> None:
        while not self._stop.is_set():
            for msg in self._consumer.consume(500, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        self._pending_eof.discard((msg.topic() or "", msg.partition() or 0))
                        if not self._pending_eof:
                            self.caught_up.set()
                    continue
                self._topics[msg.topic() or ""](msg.key(), msg.value())

    def _on_stats(self, key: bytes | None, value: bytes | None) -> None:
        if value is None:
            return
        try:
            numbers = StageStats.model_validate_json(value)
        except ValidationError:
            return  # a record of another version: the next publish replaces it
        with self._lock:
            self.stats[numbers.stage] = numbers
            trend = self.history.setdefault(numbers.stage, deque(maxlen=HISTORY))
            trend.append({"at": numbers.at, **{name: getattr(numbers, name) for name in TRENDS}})

    def _latest(self, table: dict[str, Any], model: type[BaseModel], keep_unreadable: bool, key: bytes | None,
                value: bytes | None) -> None:
        """A compacted topic's record into ``table``, the latest value per key: a tombstone removes the key; a value
        that does not validate is skipped, or kept as None with ``keep_unreadable``."""
        name = (key or b"").decode(errors="replace")
        with self._lock:
            if value is None:
                table.pop(name, None)
                return
            try:
                table[name] = model.model_validate_json(value)
            except ValidationError:
                if keep_unreadable:  # a task source treats such a task as quarantined; so does the page
                    table[name] = None

    def task_sources(self) -> dict[str, dict[str, Any]]:
        """Per task source: its tasks by status, quarantined ones by reason, and the healthy share (of all its
        tasks with a record; unchecked ones count as not healthy)."""
        with self._lock:
            records = dict(self.tasks)
        sources: dict[str, dict[str, Any]] = {}
        for task, record in sorted(records.items()):
            source = record.source if record is not None else task.partition(":")[0]
            row = sources.setdefault(source, {"tasks": 0, "healthy": 0, "quarantined": 0, "unchecked": 0,
                                              "reasons": {}, "kiln_failures": 0})
            row["tasks"] += 1
            status = record.status if record is not None else "quarantined"
            row[status] += 1
            if status == "quarantined":
                reason = (record.reason if record is not None else None) or "unreadable"
                row["reasons"][reason] = row["reasons"].get(reason, 0) + 1
            row["kiln_failures"] += record.infra_failures if record is not None else 0
        for row in sources.values():
            row["healthy_share"] = row["healthy"] / row["tasks"]
        return sources

    def alive(self, now: float | None = None) -> list[WorkerHeartbeat]:
        """Workers whose latest heartbeat is fresh (the stats app's rule: three intervals)."""
        now = time.time() if now is None else now
        with self._lock:
            return [b for b in self.workers.values() if b.at >= now - STALE_BEATS * b.interval_s]

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows: per stage its latest numbers and their trend, the workers alive, and per task
        source its tasks' health."""
        workers = self.alive()
        with self._lock:
            stages = {stage: {**numbers.model_dump(mode="json"), "history": list(self.history.get(stage, []))}
                      for stage, numbers in sorted(self.stats.items())}
        return {"at": time.time(), "caught_up": self.caught_up.is_set(), "stages": stages,
                "workers": [b.model_dump(mode="json") for b in sorted(workers, key=lambda b: (b.stage, b.worker))],
                "task_sources": self.task_sources()}
