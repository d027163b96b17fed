"""Prometheus metrics of a worker and its HTTP endpoint (``/metrics``, ``/healthz``).

These are the autoscaler's inputs (docs/architecture.md): queue length corrected for jobs finished ahead of the
committed offset, completions in the last minute, busy and total slots, failures by reason.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class WorkerMetrics:
    def __init__(self, stage: str, worker_id: str, stage_registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry()
        self.stage_registry = stage_registry
        labels = {"stage": stage, "worker": worker_id}
        self._recent: deque[float] = deque()
        self._lock = threading.Lock()

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.slots = gauge("kiln_slots", "Job slots this worker advertises.")
        self.busy_slots = gauge("kiln_busy_slots", "Slots running a job now.")
        self.queue_length = gauge("kiln_queue_length",
                                  "Unfinished jobs on assigned partitions (lag minus jobs finished ahead).")
        self.assigned_partitions = gauge("kiln_assigned_partitions", "Partitions assigned to this worker.")
        self.paused_partitions = gauge("kiln_paused_partitions", "Assigned partitions paused for back-pressure.")
        self.readahead_bytes = gauge("kiln_readahead_bytes", "Bytes of requests buffered ahead of running jobs "
                                     "(records counted with a fixed overhead; bounded by KILN_READAHEAD_BYTES).")
        self.queued_clients = gauge("kiln_queued_clients", "Clients with jobs buffered or running on this worker "
                                    "(fair queueing shares the slots between them).")
        completions_last_minute = Gauge("kiln_completions_last_minute", "Jobs finished in the last 60 s.",
                                        list(labels), registry=self.registry).labels(**labels)
        completions_last_minute.set_function(self.completions_last_minute)
        self.completions = Counter("kiln_completions_total", "Jobs finished, by status.",
                                   [*labels, "status"], registry=self.registry)
        self.failures = Counter("kiln_failures_total", "Failed attempts ending a job, by reason.",
                                [*labels, "reason"], registry=self.registry)
        self.dead_letters = Counter("kiln_dlq_total", "Messages sent to the dead-letter topic, by reason.",
                                    [*labels, "reason"], registry=self.registry)
        self.delivery_retries = Counter("kiln_delivery_retries_total", "Replies, events and dead letters not "
                                        "delivered because the broker was unavailable, retried with backoff.",
                                        [*labels, "what"], registry=self.registry)
        self.commit_failures = Counter("kiln_commit_failures_total", "Offset commits the broker refused, by error.",
                                       [*labels, "reason"], registry=self.registry)
        self.consumer_errors = Counter("kiln_consumer_errors_total", "Consumer-thread operations that raised.",
                                       list(labels), registry=self.registry).labels(**labels)
        self.lock_expired = Counter("kiln_queue_lock_expired_total", "Queue-mode records released unrun: they "
                                    "waited so long for a slot that their lock could have run out.",
                                    list(labels), registry=self.registry).labels(**labels)
        self.offset_maps_spilled = Counter("kiln_offset_maps_spilled_total", "Finished-ahead maps too big for "
                                           "the commit metadata, stored in the blob store.",
                                           list(labels), registry=self.registry).labels(**labels)
        self.skipped = Counter("kiln_skipped_total", "Messages skipped because they finished before a restart.",
                               list(labels), registry=self.registry).labels(**labels)
        self.durations = Histogram("kiln_job_seconds", "Job duration including retries.", list(labels),
                                   registry=self.registry,
                                   buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60, 300)).labels(**labels)
        self._labels = labels
        self._by_status: dict[str, Counter] = {}

    def commit_failed(self, reason: str) -> None:
        self.commit_failures.labels(**self._labels, reason=reason[:100]).inc()

    def job_finished(self, stage: str, status: str, seconds: float, reason: str | None, dead_letter: bool) -> None:
        del stage  # the labels already carry it
        child = self._by_status.get(status)
        if child is None:  # labels() per job costs more than the increment: one child per status, kept
            child = self._by_status[status] = self.completions.labels(**self._labels, status=status)
        child.inc()
        self.durations.observe(seconds)
        if reason and status == "error":
            self.failures.labels(**self._labels, reason=reason).inc()
        now = time.monotonic()
        with self._lock:
            self._recent.append(now)

    def delivery_retried(self, what: str) -> None:
        self.delivery_retries.labels(**self._labels, what=what).inc()

    def dead_lettered(self, reason: str) -> None:
        self.dead_letters.labels(**self._labels, reason=reason).inc()

    def completions_last_minute(self) -> float:
        cutoff = time.monotonic() - 60
        with self._lock:
            while self._recent and self._recent[0] < cutoff:
                self._recent.popleft()
            return float(len(self._recent))

    def render(self) -> bytes:
        extra = generate_latest(self.stage_registry) if self.stage_registry is not None else b""
        return generate_latest(self.registry) + extra


Route = Callable[[str], tuple[int, str, bytes]]
"""An HTTP GET handler: path -> status, content type, body."""


def serve_routes(host: str, port: int, routes: dict[str, Route],
                 name: str = "kiln-http") -> ThreadingHTTPServer:
    """Serve GET by path prefix (the handler gets the full path) in a daemon thread; anything else is 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            prefix = next((p for p in routes if self.path.startswith(p)), None)
            code, ctype, body = routes[prefix](self.path) if prefix else (404, "text/plain", b"not found\n")
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def health_route(health: Callable[[], dict[str, Any]]) -> Route:
    """``/healthz``: the state as JSON, 200 when its status is ok, else 503."""
    def answer(_path: str) -> tuple[int, str, bytes]:
        state = health()
        return 200 if state.get("status") == "ok" else 503, "application/json", json.dumps(state).encode()
    return answer


def serve_http(host: str, port: int, metrics: WorkerMetrics,
               health: Callable[[], dict[str, Any]]) -> ThreadingHTTPServer:
    """Serve /metrics and /healthz in a daemon thread (host ``0.0.0.0`` in containers, loopback otherwise)."""
    return serve_routes(host, port, {"/metrics": lambda _p: (200, CONTENT_TYPE_LATEST, metrics.render()),
                                     "/healthz": health_route(health)}, name="kiln-metrics")


def start_worker_endpoints(loop: asyncio.AbstractEventLoop, stop: Callable[[], None], host: str, port: int,
                           metrics: WorkerMetrics, health: Callable[[], dict[str, Any]], *,
                           install_signal_handlers: bool, serve_metrics: bool) -> ThreadingHTTPServer | None:
    """What every worker mode starts: SIGTERM/SIGINT -> graceful ``stop``, and the metrics/health endpoint."""
    if install_signal_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
    return serve_http(host, port, metrics, health) if serve_metrics else None
