"""Fixtures of the streams tests: a blob store of each kind, a topology under a test-unique prefix, and the stats
app as a real process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.streams import admin
from kiln.streams.blobstore import BlobStore, FileBlobStore, open_blob_store
from kiln.streams.processes import StatsProcess
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import COMPACTED, HEARTBEATS_TOPIC, REDRIVES_TOPIC, STATS_TOPIC, TASK_HEALTH_TOPIC, TopicSpec


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> BlobStore:
    if request.param == "file":
        return FileBlobStore(tmp_path / "blobs")
    s3: KilnSettings = request.getfixturevalue("s3_settings")
    return open_blob_store(s3.model_copy(update={"blob_store": f"s3://kiln-test-{unique}/pre"}))


@pytest.fixture
def ops_topics(kafka: KilnSettings, unique: str, tmp_path: Path) -> Iterator[Callable[..., KilnSettings]]:
    """``ops_topics(("sleep.requests", 4))``: those topics (+ DLQ twins), kiln.results, kiln.heartbeats, kiln.stats,
    kiln.redrives and kiln.tasks.health under a fresh prefix; everything under the prefix (faust's own topics too) is
    deleted afterwards."""
    settings = kafka.model_copy(update={"topic_prefix": f"t{unique}.", "cache": tmp_path / "cache"})

    def make(*topics: tuple[str, int]) -> KilnSettings:
        specs = [TopicSpec("kiln.results", 2), TopicSpec(HEARTBEATS_TOPIC, 1, COMPACTED),
                 TopicSpec(STATS_TOPIC, 1, COMPACTED), TopicSpec(REDRIVES_TOPIC, 1, COMPACTED),
                 TopicSpec(TASK_HEALTH_TOPIC, 1, COMPACTED)]
        for name, partitions in topics:
            specs += [TopicSpec(name, partitions), TopicSpec(f"{name}.dlq", 1)]
        admin.create_topics(settings, specs)
        return settings

    yield make
    names = admin.admin_client(settings).list_topics(timeout=10).topics
    admin.delete_topics(settings, [n for n in names if n.startswith(settings.topic_prefix)])


@pytest.fixture
def stats_process(tmp_path: Path) -> Iterator[Callable[..., StatsProcess]]:
    started: list[StatsProcess] = []

    def start(settings: KilnSettings, **env: str) -> StatsProcess:
        process = StatsProcess(settings, tmp_path / f"stats-{len(started)}.log", **env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
