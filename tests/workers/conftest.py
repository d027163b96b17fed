"""Stage tests run real worker processes on topics under a test-unique prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.streams import admin
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec


@pytest.fixture
def stage_topics(kafka: KilnSettings, unique: str, tmp_path: Path) -> Iterator[Callable[..., KilnSettings]]:
    """``stage_topics(("repo.ingest", 2), ...)``: creates those topics (+ DLQ twins, + kiln.results) under a fresh
    prefix; returns settings carrying the prefix and a private cache. Deleted afterwards."""
    settings = kafka.model_copy(update={"topic_prefix": f"t{unique}.", "cache": tmp_path / "cache"})
    created: list[str] = []

    def make(*topics: tuple[str, int]) -> KilnSettings:
        specs = [TopicSpec("kiln.results", 2)]
        for name, partitions in topics:
            specs.append(TopicSpec(name, partitions))
            if not name.endswith(".events"):
                specs.append(TopicSpec(f"{name}.dlq", 1))
        admin.create_topics(settings, specs)
        created.extend(settings.topic(s.name) for s in specs)
        return settings

    yield make
    if created:
        admin.delete_topics(settings, created)


def worker_env(settings: KilnSettings, **extra: str) -> dict[str, str]:
    return {"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache), **extra}
