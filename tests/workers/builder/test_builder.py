"""The image builder on real Docker: one generated project per build system, ambiguity, broken projects, unified
coverage with exact line counts, and the build cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.workers.builder.errors import PlanError
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.rules import plan
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits
from tests.ingest.gitrepos import write
from tests.workers.builder.projects import EXPECTED, PROJECTS, ingested_store, python_project

BASES = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
LIMITS = Limits(memory_bytes=1 << 30, cpus=2, pids=512, timeout_s=300)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> SaucerStore:
    return ingested_store(tmp_path_factory.mktemp("builder"), PROJECTS, "demo")


async def build(store: SaucerStore, docker: Any, name: str, tmp: Path, **kwargs: Any) -> BuildEvent:
    return await build_revision(BuildRequest(repository=f"demo/{name}", **kwargs), store, docker, BASES, tmp, LIMITS)


def test_rules_explain_their_choices(tmp_path: Path) -> None:
    def checkout(files: dict[str, str]) -> Path:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for rel, text in files.items():
            write(root, rel, text)
        return root

    both = plan(checkout({"CMakeLists.txt": "project(x)\n", "Makefile": "all:\n\ttrue\n"}))
    assert both.system == "cmake" and "beats a Makefile" in both.decisions[-2].reason
    ci = plan(checkout({"pyproject.toml": "[project]\nname='x'\n", "package.json": '{"scripts": {"test": "x"}}',
                        ".github/workflows/ci.yml": "jobs:\n  t:\n    steps:\n      - run: pytest -x tests/unit\n"}))
    assert ci.system == "python" and "CI runs 'pytest -x tests/unit'" in ci.decisions[2].reason
    assert "-x tests/unit" in ci.test_script
    go = plan(checkout({"go.mod": "module m\n\ngo 1.22\n"}))
    assert go.toolchain["go"].startswith("go.mod says 1.22")
    with pytest.raises(PlanError, match="newer than the toolchain"):
        plan(checkout({"go.mod": "module m\n\ngo 9.1\n"}))
    with pytest.raises(PlanError, match="requires-python"):
        plan(checkout({"pyproject.toml": "[project]\nname='x'\nrequires-python='>=3.13'\n"}))
    docker = plan(checkout({"Dockerfile": "FROM debian:bookworm-slim AS b\nFROM b\n", "Makefile": "test:\n\ttrue\n"}))
    assert docker.recipe == "dockerfile" and "kiln-local-image:base" in (docker.dockerfile or "")
    for image in ("ubuntu:22.04", "ghcr.io/acme/app:1", "alpine"):
        with pytest.raises(PlanError, match="FROM"):
            plan(checkout({"Dockerfile": f"FROM {image}\n"}))
    with pytest.raises(PlanError, match="no rule matched"):
        plan(checkout({"README.md": "hello\n"}))


@pytest.mark.docker
@pytest.mark.parametrize("name", ["python", "go", "cargo", "npm", "cmake", "make", "ambiguous", "dockerfile"])
async def test_each_build_system_builds_runs_tests_and_reports_coverage(name: str, store: SaucerStore,
                                                                        docker_engine: Any, tmp_path: Path) -> None:
    event = await build(store, docker_engine, name, tmp_path)
    assert event.status == "built" and event.usable, (event.failure, event.detail)
    assert event.image and docker_engine.images.get(event.image).labels["kiln.commit"] == event.commit
    tests = event.tests
    assert tests is not None and tests.failed == 0 and tests.passed >= 1
    if name == "ambiguous":
        assert event.system == "cmake"
        assert any("beats a Makefile" in d.reason for d in event.decisions)
    if name == "dockerfile":
        assert event.recipe == "dockerfile" and any(d.topic == "base image" for d in event.decisions)
    if name in EXPECTED:
        want = EXPECTED[name]
        assert tests.passed == want["tests"]
        coverage = tests.coverage
        assert coverage is not None
        files = {f.path: f for f in coverage.files}
        assert set(files) == {want["file"]}, files.keys()
        assert (len(files[want["file"]].executable_lines), len(files[want["file"]].covered_lines)) == (
            want["executable"], want["covered"])
        assert (coverage.lines_total, coverage.lines_covered) == (want["executable"], want["covered"])
    if name in ("cmake", "make", "ambiguous"):
        coverage = tests.coverage
        assert coverage is not None and coverage.tool == "gcov"
        calc = next(f for f in coverage.files if f.path.endswith("calc.c"))
        assert 0 < len(calc.covered_lines) < len(calc.executable_lines)  # sub() never runs
    if name == "npm":
        assert tests.coverage is not None and tests.coverage.tool == "c8"


@pytest.mark.docker
@pytest.mark.parametrize(("name", "failure"), [("broken-compile", "compile_failed"),
                                               ("broken-deps", "dependency_install_failed"),
                                               ("no-rule", "no_rule_matched")])
async def test_broken_projects_get_their_failure_class(name: str, failure: str, store: SaucerStore,
                                                       docker_engine: Any, tmp_path: Path) -> None:
    event = await build(store, docker_engine, name, tmp_path)
    assert (event.status, event.failure, event.usable) == ("failed", failure, False)
    assert event.detail
    # A dependency install can fail for a passing reason (a registry hiccup): that outcome is not cached forever.
    again = await build(store, docker_engine, name, tmp_path)
    assert again.cached == (failure != "dependency_install_failed")


@pytest.mark.docker
async def test_builds_are_cached_and_dependency_layers_reused(store: SaucerStore, docker_engine: Any,
                                                              tmp_path: Path) -> None:
    first = await build(store, docker_engine, "python", tmp_path)
    again = await build(store, docker_engine, "python", tmp_path)
    assert again.cached and again.image == first.image and again.commit == first.commit
    # A new revision that changes sources only reuses the dependency layer.
    source = tmp_path / "evolving"
    b = python_project(source)
    write(source, "calc/extra.py", "def neg(a):\n    return -a\n")
    b.commit("add a module")
    event = await ingest(IngestRequest(name="demo/evolving", location=str(source)), "r-ev", store, tmp_path / "w")
    assert event.status == "ingested"
    evolved = await build(store, docker_engine, "evolving", tmp_path)
    assert evolved.usable and evolved.dependency_layer_cached and evolved.dependency_image == first.dependency_image
