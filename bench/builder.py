"""Build every generated project (one per build system, plus the ambiguous and broken ones) through the builder
on real Docker: cold (``force``: no build cache, a fresh dependency image, no Docker layer cache) and cached (the
same revision asked again).

These are fixtures written alongside the rules (tests/workers/builder/projects.py), so their success rate says that
the rules do what they were written to do, not how the builder fares on real repositories. Prints
``build_success_rate_fixtures`` (usable builds / fixtures that should build), ``build_s_<system>`` (cold) and
``build_s_<system>_cached`` per fixture.
Usage: python -m bench.builder

``--real``: the real-repository corpus instead (``bench/corpus/projects.toml``, fetched by ``bench/corpus.py``):
each project ingested through Saucer and built cold by the rules alone (``--agent``: the deterministic agent on what
the rules could not build). A project counts as usable only when kiln's image ran its tests with per-test results
(``tests_not_itemised`` never counts), ≥ 1 passing, and kiln executed ≥ 80 % of the tests its human-known command
runs (that command run in the same image, its count read from the runner's own summary — every system has one,
make-driven and npm suites through ``reports.runner_summary``; a summary that does not parse counts as not usable;
the human count is taken whenever the image built). Every project of the corpus is
in the denominator, those rejected before the build (fetch or checksum failures) included. Prints
``build_success_rate_real`` (overall, per system, rules vs agent), failures per class, and the per-project table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.common import report
from bench.corpus import Project, prepare, projects
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.images import ImageContract
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.workers.builder.agent import AgentConfig
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits, docker_client, run_sandboxed
from kiln.workers.common.reports import runner_summary
from tests.workers.builder.projects import PROJECTS

BASES = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
SHOULD_FAIL = {"broken-compile", "broken-deps", "no-rule"}


SUMMARIES = {  # the tool's own summary of what ran: (pattern, which groups count as executed)
    "python": re.compile(r"(\d+) (passed|failed)"),
    "cargo": re.compile(r"test result: \w+\. (\d+) (passed); (\d+) (failed)"),
    "go": re.compile(r"^\s*--- (PASS|FAIL)", re.MULTILINE),
    "cmake": re.compile(r"tests passed, \d+ tests failed out of (\d+)"),
    # automake's per-test lines, or a banner per make target where the suite prints only those (zlib's "make test":
    # "*** zlib shared test OK ***").
    "autotools": re.compile(r"^(?:(PASS|FAIL|XFAIL|XPASS): |[ \t]*\*{3} .+ (OK|FAILED) \*{3}[ \t]*$)", re.MULTILINE),
}


def human_count(system: str, output: str) -> int:
    """How many tests the human-known command executed, from its own summary lines: npm runners (mocha, jest,
    vitest, ava, TAP, node) and make-driven suites by their runner's summary line (``47 passing``, ``Tests:  46
    passed, 47 total``, ``# pass 3``, ``Tests passed: 349``, GoogleTest's and Unity's); autotools suites by their
    per-test lines (automake's ``PASS: t``, zlib's ``*** zlib test OK ***``)."""
    pattern = SUMMARIES.get(system)
    if pattern is None:
        summary = runner_summary(output)
        return sum(summary) if summary else 0
    if system == "python":  # the last "=== N passed, M failed ... in Xs ===" line
        lines = [ln for ln in output.splitlines() if re.search(r"(passed|failed).* in [\d.]+s", ln)]
        return sum(int(m.group(1)) for m in pattern.finditer(lines[-1])) if lines else 0
    if system == "cargo":
        return sum(int(m.group(1)) + int(m.group(3)) for m in pattern.finditer(output))
    if system in ("go", "autotools"):
        return len(pattern.findall(output))
    match = pattern.search(output)
    return int(match.group(1)) if match else 0


@dataclass
class RealOutcome:
    event: BuildEvent
    human: int  # tests the human-known command executed in the same image
    seconds: float

    @property
    def usable(self) -> bool:
        """Built, ≥ 1 test passed, and kiln ran ≥ 80 % of what the human-known command runs. A human count of 0
        (its summary did not parse, or it ran nothing) leaves nothing to compare with: not usable."""
        tests = self.event.tests
        return bool(self.event.usable and tests and tests.passed >= 1 and self.human > 0
                    and tests.passed + tests.failed >= 0.8 * self.human)

    @property
    def outcome(self) -> str:
        if self.usable:
            return "usable"
        if self.event.failure:
            return self.event.failure
        if not self.event.usable:
            return "failed"
        return "human count unparsed" if self.human == 0 else "too few tests"


async def build_real(project: Project, source: Path, store: SaucerStore, client: Any, work: Path,
                     agent: AgentConfig | None = None) -> RealOutcome:
    """Ingest one corpus project, build it cold, and run its human-known command in the image to count its tests."""
    limits = Limits(memory_bytes=2 << 30, cpus=2, pids=1024, timeout_s=900)
    os.environ["KILN_INGEST_LOCAL_ROOTS"] = json.dumps([tempfile.gettempdir(), str(source.parent)])
    await ingest(IngestRequest(name=f"corpus/{project.slug}", location=str(source)), project.slug, store, work)
    started = time.monotonic()
    event = await build_revision(BuildRequest(repository=f"corpus/{project.slug}", force=True), store, client,
                                 BASES, work, limits, agent=agent)
    seconds, human = time.monotonic() - started, 0
    if event.image:  # built: the human count, also for a run kiln could not itemise
        command = project.test.replace("go test", "go test -v") if project.system == "go" else project.test
        env = ImageContract.from_labels(client.images.get(event.image).labels).env
        # As a person would in this image: the project's virtualenv (Python) first on PATH.
        reference = await asyncio.to_thread(
            run_sandboxed, client, event.image, f"export PATH=/opt/venv/bin:$PATH; cd /work && {command}",
            limits=limits, role="build-test", env=env)
        human = human_count(project.system, reference.output)
    return RealOutcome(event, human, seconds)


async def real(with_agent: bool, only: list[str]) -> None:
    run_steps(COMPONENT_STEPS["docker"])
    client = docker_client()
    rows: list[tuple[str, ...]] = []
    counted: dict[str, list[bool]] = {}
    failures: dict[str, int] = {}
    by_agent = 0
    with tempfile.TemporaryDirectory() as tmp, Progress() as progress:
        root = Path(tmp)
        store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
        # --only builds in the order given (what matters first), the whole corpus in its own order.
        chosen = [p for name in only for p in projects() if p.name == name] if only else projects()
        task = progress.add_task("building the real corpus", total=len(chosen))
        for project in chosen:
            progress.update(task, description=f"{project.ecosystem} {project.name}")
            try:
                source = prepare(project)
            except Exception as e:  # still a project of the corpus: it counts, as not usable
                rows.append((project.slug, project.system, "rejected", "", "", "", str(e)[:60]))
                counted.setdefault(project.system, []).append(False)
                failures["rejected"] = failures.get("rejected", 0) + 1
                progress.advance(task)
                continue
            result = await build_real(project, source, store, client, root / "work",
                                      AgentConfig() if with_agent else None)
            event = result.event
            counted.setdefault(project.system, []).append(result.usable)
            by_agent += result.usable and event.recipe == "agent"
            if not result.usable:
                failures[result.outcome] = failures.get(result.outcome, 0) + 1
            rows.append((project.slug, event.system or "-", result.outcome,
                         f"{event.tests.passed}/{event.tests.failed}" if event.tests else "-", str(result.human),
                         f"{result.seconds:.0f}",
                         (event.detail or "").strip().splitlines()[-1][:60] if event.detail else ""))
            progress.console.print(" | ".join(rows[-1]))  # each project as it finishes: a long run can be followed
            progress.advance(task)
    table = Table("project", "system", "outcome", "passed/failed", "human count", "s", "detail",
                  title="builder on the real corpus")
    for row in rows:
        table.add_row(*row)
    Console(stderr=True, width=200).print(table)
    every = [ok for oks in counted.values() for ok in oks]
    total = max(1, len(every))
    metrics = {"build_success_rate_real": round(sum(every) / total, 3), "build_projects_real": float(len(every)),
               "build_success_rate_real_rules": round((sum(every) - by_agent) / total, 3),
               "build_usable_by_agent": float(by_agent)}
    metrics.update({f"build_success_rate_real_{system}": round(sum(oks) / len(oks), 3)
                    for system, oks in sorted(counted.items())})
    metrics.update({f"build_failures_{kind.replace(' ', '_')}": float(n) for kind, n in sorted(failures.items())})
    report("builder: real repositories from their source artefacts", metrics)


async def main() -> None:
    run_steps(COMPONENT_STEPS["docker"])
    client = docker_client()
    bases = BASES
    limits = Limits(memory_bytes=1 << 30, timeout_s=600)
    metrics: dict[str, float] = {}
    usable = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
        for name, make in PROJECTS.items():
            make(root / "src" / name)
            await ingest(IngestRequest(name=f"bench/{name}", location=str(root / "src" / name)), name, store,
                         root / "work")
        for name in PROJECTS:
            # Cold: force = no build cache, a fresh dependency image, no Docker layer cache.
            request = BuildRequest(repository=f"bench/{name}", force=True)
            started = time.monotonic()
            event = await build_revision(request, store, client, bases, root / "work", limits)
            metrics[f"build_s_{name}"] = round(time.monotonic() - started, 2)
            started = time.monotonic()
            cached = await build_revision(request.model_copy(update={"force": False}), store, client, bases,
                                          root / "work", limits)
            metrics[f"build_s_{name}_cached"] = round(time.monotonic() - started, 3)
            assert cached.cached
            if name not in SHOULD_FAIL and event.usable:
                usable += 1
            metrics[f"build_ok_{name}"] = float(event.usable if name not in SHOULD_FAIL else
                                                event.failure is not None)
    metrics = {"build_success_rate_fixtures": round(usable / (len(PROJECTS) - len(SHOULD_FAIL)), 3), **metrics}
    report("builder: generated fixture projects (written to match the rules), cold and cached", metrics)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="the real-repository corpus")
    parser.add_argument("--agent", action="store_true", help="with --real: the agent on what the rules cannot build")
    parser.add_argument("--only", nargs="*", default=[], help="with --real: these projects (by name) only")
    args = parser.parse_args()
    asyncio.run(real(args.agent, args.only) if args.real else main())
