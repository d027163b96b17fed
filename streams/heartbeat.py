"""Worker heartbeats: every ``KILN_HEARTBEAT_S`` a worker publishes its slots, busy slots and state to the compacted
``kiln.heartbeats`` topic, and a tombstone when it stops. The stats stream (``streams/stats``) averages them per stage,
so worker counts come from the workers themselves and never from polling their endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kiln.schemas.ops import WorkerHeartbeat
from kiln.streams.executor import JobExecutor
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import HEARTBEATS_TOPIC

log = logging.getLogger("kiln.heartbeat")
STALE_BEATS = 3
"""A worker whose heartbeat is this many intervals old is not counted as alive."""


class Heartbeat:
    """Publishes ``health()`` as a ``WorkerHeartbeat`` until ``stop()``, through the worker's own producer
    (acks=all): a heartbeat that lands means the worker reaches the broker."""

    def __init__(self, settings: KilnSettings, executor: JobExecutor, health: Callable[[], dict[str, Any]], *,
                 topic: str, group: str, mode: str) -> None:
        self.settings = settings
        self._executor = executor
        self._health = health
        self._topic = topic
        self._group = group
        self._mode = mode
        self._task: asyncio.Task[None] | None = None
        self._published = False

    def beat(self) -> WorkerHeartbeat:
        state = self._health()
        status = state["status"] if state["status"] in ("starting", "ok", "stopping", "failed") else "failed"
        return WorkerHeartbeat(worker=state["worker"], stage=state["stage"], topic=self._topic, group=self._group,
                               mode="queue" if self._mode == "queue" else "group", slots=state["slots"],
                               busy=state["busy_slots"], state=status, interval_s=self.settings.heartbeat_s,
                               at=time.time(), gauges=self._gauges())

    def _gauges(self) -> dict[str, float]:
        read = self._executor.stage.gauges
        if read is None:
            return {}
        try:
            return dict(list(read().items())[:64])
        except Exception as e:  # a stage's gauge must not silence the worker's heartbeat
            log.warning("stage gauges failed: %r", e)
            return {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kiln-heartbeat")

    async def _run(self) -> None:
        # A deployment without the topic (topics not created, a test's private prefix) runs unobserved rather than
        # queueing heartbeats that can only time out.
        target = self.settings.topic(HEARTBEATS_TOPIC)
        if not await self._executor.producer.partitions(target):
            log.warning("no topic %s: this worker publishes no heartbeats (create it: kiln topics create)", target)
            return
        self._published = True
        while True:
            beat = self.beat()
            try:
                await asyncio.wait_for(self._send(beat.worker, beat.model_dump_json().encode()),
                                       self.settings.heartbeat_s * 2)
            except Exception as e:  # the broker being away must not stop the worker; the next beat retries
                log.warning("heartbeat not published: %r", e)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _send(self, worker: str, value: bytes | None) -> None:
        await self._executor.producer.produce(self.settings.topic(HEARTBEATS_TOPIC), value, key=worker)

    async def stop(self) -> None:
        """Stop beating and publish the tombstone: the worker is gone, not silent."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if not self._published:
            return
        try:
            await asyncio.wait_for(self._send(self.beat().worker, None), 10)
        except Exception as e:
            log.warning("heartbeat tombstone not published: %r", e)
