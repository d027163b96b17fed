"""The task-health board: the latest ``TaskHealth`` of every task on the compacted ``kiln.tasks.health`` topic
(``kiln tasks health`` writes it), for a task source that must not serve a quarantined task (``RepositoryTasks``)
and for the health run, which judges each task against its previous record."""

from __future__ import annotations

import logging
import os
import threading
import time

from pydantic import ValidationError

from kiln.schemas.tasks import TaskHealth
from kiln.streams.producer import publish_records
from kiln.streams.replay import read_topic
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TASK_HEALTH_TOPIC

log = logging.getLogger("kiln.tasks.health")


class TaskHealthBoard:
    """The topic read from its start into the latest record per task; read again when older than ``refresh_s``
    (0: at every look). A record this reader cannot read (written by a newer kiln, or damaged) counts its task as
    quarantined: a task source fails closed rather than serve a task it cannot vouch for."""

    def __init__(self, settings: KilnSettings, refresh_s: float = 30.0) -> None:
        self.settings = settings
        self.refresh_s = refresh_s
        self._records: dict[str, TaskHealth] = {}
        self._unreadable: set[str] = set()
        self._read_at: float | None = None
        self._reading = threading.Lock()

    def refresh(self) -> dict[str, TaskHealth]:
        """Read the topic to its end now (``ConfigError`` when it does not exist: ``kiln topics create`` makes
        it)."""
        records: dict[str, TaskHealth] = {}
        unreadable: set[str] = set()
        for record in read_topic(self.settings, TASK_HEALTH_TOPIC):
            key = (record.key() or b"").decode(errors="replace")
            value = record.value()
            records.pop(key, None)
            unreadable.discard(key)
            if value is None:  # a tombstone: the task was forgotten
                continue
            try:
                records[key] = TaskHealth.model_validate_json(value)
            except ValidationError as e:
                log.warning("task %s: health record not readable here, treated as quarantined: %s", key, e)
                unreadable.add(key)
        self._records, self._unreadable, self._read_at = records, unreadable, time.monotonic()
        return records

    def _fresh(self) -> None:
        with self._reading:  # one read at a time; a caller waiting for it takes its result
            if self._read_at is None or time.monotonic() - self._read_at >= self.refresh_s:
                self.refresh()

    def records(self) -> dict[str, TaskHealth]:
        """The latest record of every task that has one."""
        self._fresh()
        return dict(self._records)

    def get(self, task_id: str) -> TaskHealth | None:
        """The latest record of one task (None: it has none)."""
        self._fresh()
        return self._records.get(task_id)

    def quarantined(self) -> set[str]:
        """Task ids not to serve: quarantined, or with a record this reader cannot read."""
        self._fresh()
        return {k for k, r in self._records.items() if r.status == "quarantined"} | self._unreadable


def publish_health(settings: KilnSettings, records: list[TaskHealth]) -> None:
    """Write ``records`` to ``kiln.tasks.health`` (keyed by task id), returning once the broker has them all."""
    publish_records(settings, TASK_HEALTH_TOPIC, [(r.task_id, r) for r in records], f"kiln-tasks-{os.getpid()}")
