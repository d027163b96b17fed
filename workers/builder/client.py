"""Client facade of the ``build`` stage."""

from __future__ import annotations

from typing import Any

from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.streams.client import KilnClient


class BuilderClient:
    """Build requests over a shared ``KilnClient``."""

    def __init__(self, kiln: KilnClient) -> None:
        self.kiln = kiln

    async def build(self, request: BuildRequest, **kwargs: Any) -> BuildEvent:
        """Build (or look up the cached outcome of) a repository revision; keyed by repository."""
        event: BuildEvent = await self.kiln.call("build", request, key=request.repository, **kwargs)
        return event
