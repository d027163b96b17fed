"""``build``: ``image.build`` -> ``image.events``."""

from __future__ import annotations

from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.streams.stage import Deployment, StageSpec


def _facets(event: BuildEvent) -> dict[str, str | float]:
    """Outcome per build system, so the status page shows which systems fail and by which class."""
    system = event.system or "none"
    outcome = "built" if event.status == "built" else (event.failure or "failed")
    return {"system": system, "outcome": outcome, "system/outcome": f"{system}/{outcome}"}


build = StageSpec("build", "image.build", BuildRequest, BuildEvent, handler="kiln.workers.builder.stage:stage",
                  events_topic="image.events", facets=_facets,
                  deployment=Deployment(slots=2, memory_per_slot_mib=4096, max_workers=20, container_engine=True))
