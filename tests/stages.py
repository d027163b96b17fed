"""Stage tests run real worker processes on topics under a test-unique prefix: the fixtures that the stages' tests,
the RL loop's and the integrations' share (registered for the whole suite by tests/conftest.py, so a session-scoped
image is built once)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams import admin
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits
from tests.workers.builder.projects import cmake_project, make_project, python_project


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


def _built_image(docker_engine: Any, root: Path, project: Callable[[Path], object], repository: str) -> str:
    """``project`` ingested and built by the builder (rules, tests run): the image's reference."""
    store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
    project(root / "src")
    assert asyncio.run(ingest(IngestRequest(name=repository, location=str(root / "src")), "r", store,
                              root / "w")).status == "ingested"
    event = asyncio.run(build_revision(BuildRequest(repository=repository), store, docker_engine,
                                       BaseImages("kiln/base:latest", "kiln/toolchain:latest"), root / "w",
                                       Limits(timeout_s=300)))
    assert event.usable and event.image, event.detail
    return event.image


@pytest.fixture(scope="session")
def project_image(docker_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Python project ingested and built once per session: an image exec sessions may open."""
    return _built_image(docker_engine, tmp_path_factory.mktemp("exec-image"), python_project, "demo/exec")


@pytest.fixture(scope="session")
def make_image(docker_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A C project whose ``make test`` is a test binary printing its own per-test lines and count (no reporter
    kiln can choose), built once per session."""
    return _built_image(docker_engine, tmp_path_factory.mktemp("make-image"), make_project, "demo/make")


@pytest.fixture(scope="session")
def cmake_image(docker_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A C project tested by CTest (which runs the binaries under build/ as they were built), built once."""
    return _built_image(docker_engine, tmp_path_factory.mktemp("cmake-image"), cmake_project, "demo/cmake")
