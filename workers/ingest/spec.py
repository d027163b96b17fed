"""``ingest``: ``repo.ingest`` -> ``repo.events``, kept forever so a replay rebuilds Saucer's store."""

from __future__ import annotations

from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.streams.stage import StageSpec

# Keyed by the root repository, so a rewrite runs after the ingestion of its source, also in a replay.


def _facets(event: IngestEvent) -> dict[str, str | float]:
    return {"status": event.status, "reason": event.reason or "none", "strategy": event.strategy}


ingest = StageSpec("ingest", "repo.ingest", IngestRequest, IngestEvent, handler="kiln.workers.ingest.stage:stage",
                   ordering="keyed", retention="forever", events_topic="repo.events", facets=_facets)
