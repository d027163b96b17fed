"""``build``: ``image.build`` -> ``image.events``."""

from __future__ import annotations

from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.streams.stage import StageSpec

build = StageSpec("build", "image.build", BuildRequest, BuildEvent, handler="kiln.workers.builder.stage:stage",
                  events_topic="image.events")
