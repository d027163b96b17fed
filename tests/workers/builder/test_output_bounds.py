"""Memory bounded by configuration, not by the attacker: a test suite, a build step and an agent command each print
tens of MiB (and a test run leaves a larger reports directory, a layered rebuild writes a larger layer); the
builder reads all of it as a stream with a cap, so the worker's own allocations (traced by ``tracemalloc`` across
its threads) stay a few MiB whatever was printed, and what was dropped is said in the result."""

from __future__ import annotations

import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.images import REPORTS_DIR
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.cancel import in_thread
from kiln.workers.builder.agent import AgentConfig
from kiln.workers.builder.errors import StepFailed
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.layers import Diff, rebuild_layer
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits, run_sandboxed
from tests.ingest.gitrepos import Builder, write

pytestmark = pytest.mark.docker
BASES = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
MiB = 1 << 20
FLOOD = "head -c {n} /dev/zero | tr '\\0' x"
T = TypeVar("T")


async def _peak(work: Callable[[], Awaitable[T]]) -> tuple[T, int]:
    """The result of ``work`` and the most memory Python allocated (in any thread) while it ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = await work()
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


async def test_a_test_run_floods_output_and_reports(docker_engine: Any) -> None:
    script = (f"{FLOOD.format(n=128 * MiB)}; mkdir -p {REPORTS_DIR}; "
              f"head -c {64 * MiB} /dev/zero > {REPORTS_DIR}/junit.xml; echo the-end")
    limits = Limits(timeout_s=120, output_bytes=64 << 10, collect_bytes=8 * MiB)
    run, peak = await _peak(lambda: in_thread(run_sandboxed, docker_engine, "kiln/base:latest", script,
                                              limits=limits, role="build-test", collect=REPORTS_DIR))
    assert run.exit_code == 0 and run.files == {}
    assert run.output.startswith(f"[kiln: {REPORTS_DIR} holds more than 8388608 bytes: not read]\n[kiln: ")
    assert run.output.rstrip().endswith("xxxxthe-end") and len(run.output) < 80 << 10
    assert peak < 24 * MiB, f"{peak / MiB:.1f} MiB allocated reading 128 MiB of output and 64 MiB of reports"


async def _build(docker: Any, tmp_path: Path, name: str, files: dict[str, str], **build: Any) -> Any:
    b = Builder(tmp_path / "src")
    for path, data in files.items():
        write(tmp_path / "src", path, data)
    b.commit("a repository that floods its builder with output")
    store = SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")
    await ingest(IngestRequest(name=name, location=str(tmp_path / "src")), "r", store, tmp_path / "w")
    return await build_revision(BuildRequest(repository=name, force=True), store, docker, BASES, tmp_path / "w",
                                Limits(timeout_s=120), **build)


async def test_a_build_step_floods_its_log(docker_engine: Any, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_BUILD_LOG_BYTES", str(256 << 10))
    dockerfile = f"FROM debian:bookworm\nRUN {FLOOD.format(n=48 * MiB)}; echo; echo the-end; exit 1\n"
    event, peak = await _peak(lambda: _build(docker_engine, tmp_path, "attack/flood-build", {"Dockerfile": dockerfile}))
    assert event.failure == "compile_failed" and "the-end" in event.detail, event.detail
    assert peak < 24 * MiB, f"{peak / MiB:.1f} MiB allocated reading a 48 MiB build log"


async def test_an_agent_command_floods_its_output(docker_engine: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_BUILD_LOG_BYTES", str(256 << 10))
    readme = f"# tool\n\n```sh\n{FLOOD.format(n=48 * MiB)}; echo; echo the-end; exit 1\n```\n"
    event, peak = await _peak(lambda: _build(docker_engine, tmp_path, "attack/flood-agent", {"README.md": readme},
                                             agent=AgentConfig(budget=1)))
    assert event.status == "failed" and "the-end" in event.detail, event.detail
    assert peak < 24 * MiB, f"{peak / MiB:.1f} MiB allocated reading 48 MiB of an agent command's output"


async def test_a_layered_rebuild_writes_past_its_layer_cap(docker_engine: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_BUILD_LAYER_BYTES", str(4 * MiB))
    b = Builder(tmp_path / "src")
    write(tmp_path / "src", "README.md", "a repository\n")
    b.commit("one file")
    store = SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")
    await ingest(IngestRequest(name="attack/big-layer", location=str(tmp_path / "src")), "r", store, tmp_path / "w")
    repo = store.repository("attack/big-layer")

    async def rebuild() -> str:
        try:  # no changed file: the rebuild script alone writes the layer
            await in_thread(rebuild_layer, docker_engine, "kiln/toolchain:latest", repo, Diff({}, []),
                            "head -c 64M /dev/urandom > /home/kiln/big", {}, 60)
        except StepFailed as e:
            return e.log
        return "no failure"

    log, peak = await _peak(rebuild)
    assert log == f"revision rebuild wrote more than {4 * MiB} bytes (KILN_BUILD_LAYER_BYTES)"
    assert peak < 24 * MiB, f"{peak / MiB:.1f} MiB allocated reading a 64 MiB rebuild"
