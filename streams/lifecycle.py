"""One worker's lifecycle, whatever its consumption mode (consumer groups: ``streams.runtime.Worker``; share groups:
``streams.share.ShareWorker``): the job executor with its producer, the metrics/health endpoint, SIGTERM/SIGINT as a
graceful stop, the heartbeat, the consumers' start and stop within the grace period, and the health every part
reports (``health``). A mode supplies what is its own: how it consumes (``_start_consuming``, ``_serve``,
``_stop_consuming``) and what its health adds."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any, Literal

from kiln.streams.blobstore import BlobStore
from kiln.streams.executor import JobExecutor, new_worker_id
from kiln.streams.heartbeat import Heartbeat
from kiln.streams.metrics import WorkerMetrics, start_worker_endpoints
from kiln.streams.middleware import Middleware
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import Stage


class WorkerLifecycle:
    """Runs ``stage`` until ``stop()`` (or SIGTERM when ``install_signal_handlers``); see the module's docstring."""

    mode: Literal["group", "queue"]
    log: logging.Logger

    def __init__(self, stage: Stage, settings: KilnSettings, *, slots: int | None, topic: str | None, group_id: str,
                 grace_s: float | None, middleware: Sequence[Middleware] | None, blob_store: BlobStore | None,
                 worker_id: str | None) -> None:
        self.stage = stage
        self.settings = settings
        self.slots = slots or settings.job_slots(stage.slots_per_cpu)
        self.topic = settings.topic(topic or stage.spec.request_topic)
        self.dlq_topic = f"{self.topic}.dlq"
        self.group_id = group_id
        self.grace_s = settings.grace_s if grace_s is None else grace_s
        self.worker_id = worker_id or new_worker_id()
        self.metrics = WorkerMetrics(stage.name, self.worker_id, stage.registry)
        self.metrics.slots.set(self.slots)
        self.executor = JobExecutor(stage, settings, self.metrics, self.worker_id, self.dlq_topic, blob_store,
                                    middleware)
        self.ready = threading.Event()  # set once the consumers have joined their group
        self.metrics_port = 0
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- public -------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful stop: stop intake, finish running jobs within the grace period, leave the group."""
        self._stopping.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def fail(self, reason: str) -> None:
        """Stop because this worker cannot make safe progress; it exits non-zero and health says why."""
        if self.failure is None:
            self.failure = reason
        self.stop()

    def health(self) -> dict[str, Any]:
        status = "failed" if self.failure else "stopping" if self._stopping.is_set() else (
            "ok" if self.ready.is_set() else "starting")
        return {"status": status, "reason": self.failure, "stage": self.stage.name, "worker": self.worker_id,
                **self._health_details()}

    async def run(self, install_signal_handlers: bool = False, serve_metrics: bool = True) -> None:
        self._loop = asyncio.get_running_loop()
        await self._prepare()
        server = start_worker_endpoints(self._loop, self.stop, self.settings.metrics_host, self.settings.metrics_port,
                                        self.metrics, self.health, install_signal_handlers=install_signal_handlers,
                                        serve_metrics=serve_metrics)
        self.metrics_port = server.server_address[1] if server else 0
        await self.executor.start(self._loop, self.slots)
        heartbeat = Heartbeat(self.settings, self.executor, self.health, topic=self.topic, group=self.group_id,
                              mode=self.mode)
        heartbeat.start()
        self._start_consuming()
        try:
            await self._serve()
        finally:
            self._stopping.set()
            await self._stop_consuming()
            await heartbeat.stop()
            await self.executor.close()
            if server:
                server.shutdown()
            self.log.info("worker %s stopped", self.worker_id)

    # ---- what a mode supplies -----------------------------------------------------------------------------

    def _wake(self) -> None:
        """(Event loop.) A stop was asked for: wake what ``_serve`` waits on."""

    def _health_details(self) -> dict[str, Any]:
        """What the mode's health adds (busy slots, slots, ...)."""
        return {"slots": self.slots}

    async def _prepare(self) -> None:
        """(Event loop.) Before anything starts; raising refuses the start."""

    def _start_consuming(self) -> None:
        """Start the consumers (the executor and the heartbeat run)."""
        raise NotImplementedError

    async def _serve(self) -> None:
        """Until the worker stops: run jobs as the consumers hand them over."""
        raise NotImplementedError

    async def _stop_consuming(self) -> None:
        """After ``_serve`` (``_stopping`` is set): wait for the consumers to be done."""
        raise NotImplementedError
