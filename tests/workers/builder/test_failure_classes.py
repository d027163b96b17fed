"""The failure classes of real repositories (issue 18), each as a generated repository built on real Docker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.workers.builder.service import build_revision
from tests.workers.builder.failure_classes import CLASS_PROJECTS, EXPECTED_OUTCOME
from tests.workers.builder.projects import ingested_store
from tests.workers.builder.test_builder import BASES, LIMITS

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def class_store(tmp_path_factory: pytest.TempPathFactory) -> SaucerStore:
    return ingested_store(tmp_path_factory.mktemp("classes"), CLASS_PROJECTS, "classes")


@pytest.mark.parametrize("name", sorted(CLASS_PROJECTS))
async def test_failure_class_fixture(name: str, class_store: SaucerStore, docker_engine: Any,
                                     tmp_path: Path) -> None:
    event = await build_revision(BuildRequest(repository=f"classes/{name}"), class_store, docker_engine, BASES,
                                 tmp_path, LIMITS)
    usable, failure, passed = EXPECTED_OUTCOME[name]
    assert (event.usable, event.failure) == (usable, failure), event.detail
    if passed is not None:
        assert event.tests is not None and (event.tests.passed, event.tests.failed) == (passed, 0)
    if name == "scm-version":
        assert any(d.topic == "version" and d.choice == "1.2.0" for d in event.decisions)
    if name == "unusable-dockerfile":
        assert event.recipe == "rules" and event.system == "cmake"
    if name == "collection-error":
        assert "failed to collect" in (event.detail or "")
    if name == "mocha":
        assert event.tests is not None and (event.tests.runner, event.tests.skipped) == ("mocha", 1)
        assert (event.tests.summary_passed, event.tests.summary_failed) == (2, 0)
    if name in ("jest", "vitest"):
        assert event.tests is not None and (event.tests.runner, event.tests.skipped) == (name, 1)
        # vitest 1.6's JSON counts the skipped test among numPassedTests, as tape does: still in agreement.
        assert (event.tests.summary_passed, event.tests.summary_failed) == ({"jest": 2, "vitest": 3}[name], 0)
    if name == "summary-only":  # the runner's count is in the event, not turned into one pseudo-test
        assert event.tests is not None and (event.tests.itemised, event.tests.summary_passed) == (False, 349)
        assert "the runner's summary says 349 passed, 0 failed" in (event.detail or "")
    if name == "binary-target":
        assert event.tests is not None and {c.name for c in event.tests.cases} == {"adds", "adds_zero",
                                                                                  "adds_negatives"}
    if name == "tox":
        assert next(d for d in event.decisions if d.topic == "test command").choice == "pytest tests"
        assert next(d for d in event.decisions if d.topic == "test dependencies").choice == "requirements/tests.txt"
    if name == "ld-wrap":
        assert event.tests is not None and [c.name for c in event.tests.cases] == ["calc test", "calc repeated test"]
        assert next(d for d in event.decisions if d.topic == "coverage").choice == "none"
