"""The build systems and runners of issue 50 on real Docker (tests/workers/builder/more_systems.py): each project
built, its tests run without network and read per test, or its failure class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.workers.builder.service import build_revision
from tests.workers.builder.more_systems import EXPECTED, MORE_PROJECTS
from tests.workers.builder.projects import ingested_store
from tests.workers.builder.test_builder import BASES, LIMITS

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def more_store(tmp_path_factory: pytest.TempPathFactory) -> SaucerStore:
    return ingested_store(tmp_path_factory.mktemp("more"), MORE_PROJECTS, "more")


@pytest.mark.timeout(900)  # cold: the JDK/Maven, Gradle and meson layers are built the first time
@pytest.mark.parametrize("name", sorted(MORE_PROJECTS))
async def test_more_systems(name: str, more_store: SaucerStore, docker_engine: Any, tmp_path: Path) -> None:
    event = await build_revision(BuildRequest(repository=f"more/{name}"), more_store, docker_engine, BASES, tmp_path,
                                 LIMITS)
    usable, failure, passed, runner = EXPECTED[name]
    assert (event.usable, event.failure) == (usable, failure), event.detail
    if passed is not None:
        assert event.tests is not None and (event.tests.passed, event.tests.failed) == (passed, 0)
        assert event.tests.runner == runner
    if name == "maven":
        assert event.tests is not None and {c.name for c in event.tests.cases} == {
            "com.example.CalcTest.adds", "com.example.CalcTest.multiplies"}
        coverage = event.tests.coverage
        assert coverage is not None and coverage.tool == "jacoco"
        calc = {f.path: f for f in coverage.files}["src/main/java/com/example/Calc.java"]
        assert 0 < len(calc.covered_lines) < len(calc.executable_lines)  # mul(0, …) never runs
    if name == "gradle-8":
        assert "needs Gradle 8.5" in (event.detail or "")
    if name == "meson":
        assert event.tests is not None and {c.name for c in event.tests.cases} == {"adds", "multiplies"}
        assert event.tests.coverage is not None and "calc.c" in {f.path for f in event.tests.coverage.files}
    if name == "subdirectory-suite":
        assert next(d for d in event.decisions if d.topic == "test command").choice == "make -C tests"
    if name == "nested-harness":
        assert event.tests is not None and {c.name for c in event.tests.cases} == {"tests::adds", "tests::multiplies",
                                                                                   "ui"}
    if name in ("uvu", "ava", "tap"):
        assert event.tests is not None and {c.name for c in event.tests.cases} == {"adds", "multiplies"}
    if name in ("jasmine", "qunit"):
        separator = " " if name == "jasmine" else " > "
        assert event.tests is not None and {c.name for c in event.tests.cases} == {
            f"calc{separator}adds", f"calc{separator}multiplies"}
