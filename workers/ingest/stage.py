"""``ingest`` (Saucer): ``repo.ingest`` -> ``repo.events``. Fetch, repack deterministically, publish to the store.

In a replay (``kiln replay repo.ingest --from-beginning``) each request is re-ingested at the refs its first
ingestion recorded on ``repo.events`` (whatever the remote holds now), into whatever store this process is
configured with; requests that failed the first time are skipped, and no event is published again.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.streams.replay import read_topic
from kiln.streams.settings import get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.ingest import spec


class IngestSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_INGEST_")

    runners: int = Field(4, ge=1, le=64, description="Parallel fetches (over disjoint ref sets) per repository.")


registry = CollectorRegistry()
INGESTIONS = Counter("kiln_ingest_total", "Ingestions finished, by outcome.", ["status"], registry=registry)
FAILURES = Counter("kiln_ingest_failures_total", "Failed ingestions, by reason.", ["reason"], registry=registry)
SECONDS = Histogram("kiln_ingest_seconds", "Ingestion duration.", registry=registry,
                    buckets=(0.1, 0.5, 2, 10, 60, 300, 1800))
BYTES = Counter("kiln_ingest_pack_bytes_total", "Bytes of packs stored.", registry=registry)


class _Recorded:
    """The events of earlier ingestions, read once per replay: request id -> event."""

    def __init__(self) -> None:
        self._events: dict[str, IngestEvent] | None = None
        self._lock = asyncio.Lock()

    async def get(self, request_id: str) -> IngestEvent | None:
        async with self._lock:
            if self._events is None:
                records = await asyncio.to_thread(read_topic, get_settings(), spec.ingest.events_topic or "repo.events")
                events: dict[str, IngestEvent] = {}
                for record in records:
                    try:
                        event = IngestEvent.model_validate_json(record.value() or b"")
                    except ValueError:
                        continue
                    if event.request_id not in events or event.status == "ingested":
                        events[event.request_id] = event
                self._events = events
        return self._events.get(request_id)


_recorded = _Recorded()
_store: SaucerStore | None = None


async def handle(request: IngestRequest, ctx: JobContext) -> IngestEvent:
    global _store
    settings = get_settings()
    if _store is None:
        _store = SaucerStore.from_settings(settings)
    pin = request.pin
    if ctx.replay:
        recorded = await _recorded.get(ctx.envelope.request_id)
        if recorded is not None and recorded.status == "failed":
            return recorded
        if recorded is not None and request.location is not None:
            pin = recorded.refs
    event = await ingest(request, ctx.envelope.request_id, _store, settings.cache / "ingest-work", pin=pin,
                         runners=IngestSettings().runners)
    INGESTIONS.labels(event.status).inc()
    SECONDS.observe(event.duration_s)
    if event.status == "failed":
        FAILURES.labels(event.reason or "error").inc()
    else:
        BYTES.inc(event.pack_bytes)
    return event


stage = Stage(spec.ingest, handle, job_timeout_s=3600, max_attempts=3, registry=registry)
