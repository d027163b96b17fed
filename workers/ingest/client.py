"""Client facade of the ``ingest`` stage."""

from __future__ import annotations

from typing import Any

from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.streams.client import KilnClient


class SaucerClient:
    """Ingest or derive repositories through the stage, over a shared ``KilnClient``."""

    def __init__(self, kiln: KilnClient) -> None:
        self.kiln = kiln

    async def ingest_repository(self, request: IngestRequest, **kwargs: Any) -> IngestEvent:
        """Ingest (or derive) a repository; keyed by its root so rewrites follow their source."""
        result: IngestEvent = await self.kiln.call("ingest", request, key=request.root, **kwargs)
        return result
