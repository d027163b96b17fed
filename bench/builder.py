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
``build_success_rate_real`` (overall, per system, rules vs agent), failures per class, and the per-project table;
and the same per half of issue 50's split (``build_success_rate_real_reporting``, ``…_tuning``, per system, with
failures per system and class). ``--half reporting|tuning`` builds one half; each project's result is appended as
it finishes to ``~/.cache/kiln/corpus/results/rules-<rules version>-<half|all>.jsonl``, and a run started again goes
on from there (``--restart`` forgets them; a record keeps the tails of the build's log and of the human count's run;
the images a project's build made are removed once counted, and the toolchain layers the run built when the disk
runs low); ``--list`` lists what would be built and builds nothing; ``--stop-after S`` starts no project after
S seconds and prints the figures of what is recorded (partial).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from docker.errors import APIError
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.common import report
from bench.corpus import CACHE, Project, prepare, projects
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.images import ImageContract
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.workers.builder.agent import AgentConfig
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.rules import M2, RULES_VERSION
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits, docker_client, run_sandboxed
from kiln.workers.common.reports import printed_summary, runner_summary
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


WRAPPED = ("python", "cargo", "go", "cmake")  # runners a make target or an npm script may run


# Gradle prints no count when every test passes: the human run is followed by the root element of each JUnit XML file
# its test task wrote (results of an earlier run in the image removed first), and those are counted.
GRADLE_RESULTS = "find . -path '*/build/test-results/*' -name 'TEST-*.xml'"
GRADLE_SUITE = re.compile(r'<testsuite\b[^>]*?\btests="(\d+)"[^>]*?\bskipped="(\d+)"')


def human_command(project: Project) -> str:
    """The human-known command as the bench runs it to count: ``go test -v`` (one line per test); Maven's offline on
    the image's repository (where the dependency layer put it: a sandbox reaches no network); for Gradle, with its
    result files' suites printed afterwards (the image's Gradle user home is in its environment)."""
    if project.system == "go":
        return project.test.replace("go test", "go test -v")
    if project.system == "make":  # a target running go test: one line per test there too
        return f"export GOFLAGS=-v; {project.test}"
    if project.system == "maven":
        return re.sub(r"(^|\s)(\./)?mvnw?\b", rf"\g<1>mvn -o -s {M2}/settings.xml", project.test, count=1)
    if project.system == "gradle":
        return (f"{GRADLE_RESULTS} -delete; {project.test}; rc=$?; "
                f"{GRADLE_RESULTS} -exec grep -ho '<testsuite [^>]*>' {{}} +; exit $rc")
    return project.test


def human_count(system: str, output: str) -> int:
    """How many tests the human-known command executed, from its own summary lines: npm runners (mocha, jest,
    vitest, ava, TAP, node) and make-driven suites by their runner's summary line (``47 passing``, ``Tests:  46
    passed, 47 total``, ``# pass 3``, ``Tests passed: 349``, GoogleTest's and Unity's); autotools suites by their
    per-test lines (automake's ``PASS: t``, zlib's ``*** zlib test OK ***``); Maven's and meson's by the totals they
    print at the end (per module for Maven); Gradle's by its result files' suites (``human_command``); a make target
    or npm script that runs pytest, cargo, go test or CTest by that runner's summary."""
    if system in ("maven", "meson"):
        printed = printed_summary(system, output)
        return sum(printed) if printed else 0
    if system == "gradle":
        return sum(int(tests) - int(skipped) for tests, skipped in GRADLE_SUITE.findall(output))
    pattern = SUMMARIES.get(system)
    if pattern is None:
        summary = runner_summary(output)
        if summary:
            return sum(summary)
        # A make target or npm script running another ecosystem's runner (make test → go test, pytest, tox):
        # that runner's own summary.
        return next((n for other in WRAPPED if (n := human_count(other, output))), 0)
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
    human_output: str = ""  # the tail of that command's output

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
    seconds, human, human_output = time.monotonic() - started, 0, ""
    if event.image:  # built: the human count, also for a run kiln could not itemise
        command = human_command(project)
        env = ImageContract.from_labels(client.images.get(event.image).labels).env
        # As a person would in this image: the project's virtualenv (Python) first on PATH.
        reference = await asyncio.to_thread(
            run_sandboxed, client, event.image, f"export PATH=/opt/venv/bin:$PATH; cd /work && {command}",
            limits=limits, role="build-test", env=env)
        human, human_output = human_count(project.system, reference.output), reference.output[-1500:]
    return RealOutcome(event, human, seconds, human_output)


RESULTS = CACHE / "results"


def results_file(half: str | None, root: Path = RESULTS) -> Path:
    """Where a run's per-project results go, one JSON line each: per rules version and half, so that an interrupted
    run goes on where it stopped and a change of rules starts afresh."""
    return root / f"rules-{RULES_VERSION}-{half or 'all'}.jsonl"


def chosen_projects(only: list[str], half: str | None) -> list[Project]:
    """--only in the order given (what matters first), else the whole corpus in its own order; --half: that half."""
    every = projects()
    chosen = list(dict.fromkeys(p for name in only for p in every if p.name == name)) if only else every
    return [p for p in chosen if half is None or p.half == half]


def real_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """The rates over the recorded projects: overall, per half (issue 50's split) and per system within each."""
    metrics: dict[str, float] = {}
    groups: dict[str, list[dict[str, Any]]] = {"": records}
    for record in records:
        groups.setdefault(f"_{record['half']}", []).append(record)
    for suffix, group in groups.items():
        usable = [r for r in group if r["usable"]]
        by_agent = sum(r["by_agent"] for r in usable)
        total = max(1, len(group))
        metrics[f"build_success_rate_real{suffix}"] = round(len(usable) / total, 3)
        metrics[f"build_projects_real{suffix}"] = float(len(group))
        metrics[f"build_success_rate_real{suffix}_rules"] = round((len(usable) - by_agent) / total, 3)
        metrics[f"build_usable_by_agent{suffix}"] = float(by_agent)
        systems: dict[str, list[bool]] = {}
        failures: dict[str, int] = {}
        for r in group:
            systems.setdefault(r["system"], []).append(r["usable"])
            if not r["usable"]:
                kind = f"{r['system']}_{r['outcome']}".replace(" ", "_") if suffix else r["outcome"].replace(" ", "_")
                failures[kind] = failures.get(kind, 0) + 1
        metrics.update({f"build_success_rate_real{suffix}_{system}": round(sum(oks) / len(oks), 3)
                        for system, oks in sorted(systems.items())})
        metrics.update({f"build_failures{suffix}_{kind}": float(n) for kind, n in sorted(failures.items())})
    return metrics


LOW_DISK = 6 << 30


def _ends(text: str) -> str:
    """A log's head (why: "tests_not_itemised: …") and tail (where)."""
    return text if len(text) <= 2000 else f"{text[:500]}\n…\n{text[-1500:]}"


def free_disk(client: Any, project_started: float, run_started: float) -> None:
    """What one project's cold build left (a cold run reuses none of it): the images it built since it started — its
    image and dependency image, built or not, and the untagged steps of a build that failed (as large as the
    toolchain image they are made on); under ``LOW_DISK`` free for Docker, the toolchain layers (a JDK, a project's
    system libraries) the run built too, each built again when a later project asks for it."""
    low = shutil.disk_usage(client.info()["DockerRootDir"]).free < LOW_DISK
    toolchain = client.images.get(BASES.toolchain).attrs["Size"]
    for image in client.images.list():
        created = datetime.fromisoformat(image.attrs["Created"][:19]).replace(tzinfo=UTC).timestamp()
        ours = (any(t.startswith(("kiln/deps-", "kiln/build/corpus-")) for t in image.tags)
                or (not image.tags and image.attrs["Size"] >= toolchain))
        if (created >= project_started and ours) or (low and created >= run_started and any(
                t.startswith("kiln/toolchain-extra:") for t in image.tags)):
            with contextlib.suppress(APIError):
                client.images.remove(image.id, force=True)


async def real(with_agent: bool, only: list[str], half: str | None, restart: bool,
               stop_after_s: float | None = None) -> None:
    chosen = chosen_projects(only, half)
    results = results_file(half)
    results.parent.mkdir(parents=True, exist_ok=True)
    if restart:
        results.unlink(missing_ok=True)
    slugs = {p.slug for p in chosen}
    records = [r for r in (json.loads(line) for line in results.read_text().splitlines() if line.strip())
               if r["slug"] in slugs] if results.is_file() else []
    done = {r["slug"] for r in records}
    print(f"{len(done)} of {len(chosen)} projects already recorded in {results}: going on from there", flush=True)
    run_steps(COMPONENT_STEPS["docker"])
    client = docker_client()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp, Progress() as progress, results.open("a") as out:
        root = Path(tmp)
        store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
        task = progress.add_task("building the real corpus", total=len(chosen), completed=len(done))
        for project in chosen:
            if project.slug in done:
                continue
            if stop_after_s is not None and time.time() - started > stop_after_s:
                progress.console.print(f"stopped after {stop_after_s:.0f} s: {len(records)} of {len(chosen)} "
                                       "recorded, the figures below are partial (run again to go on)")
                break
            progress.update(task, description=f"{project.ecosystem} {project.name}")
            record: dict[str, Any] = {"slug": project.slug, "system": project.system, "half": project.half}
            try:
                source = prepare(project)
            except Exception as e:  # still a project of the corpus: it counts, as not usable
                record.update(outcome="rejected", usable=False, by_agent=False, tests="", human=0, seconds=0.0,
                              detail=str(e)[:60], log=str(e)[-1500:])
            else:
                project_started = time.time() - 2  # Docker's creation times are whole seconds
                result = await build_real(project, source, store, client, root / "work",
                                          AgentConfig() if with_agent else None)
                event = result.event
                free_disk(client, project_started, started)
                record.update(outcome=result.outcome, usable=result.usable,
                              by_agent=result.usable and event.recipe == "agent",
                              tests=f"{event.tests.passed}/{event.tests.failed}" if event.tests else "-",
                              human=result.human, seconds=round(result.seconds, 1),
                              detail=(event.detail or "").strip().splitlines()[-1][:60] if event.detail else "",
                              log=_ends(event.detail or ""), human_log=result.human_output)
            out.write(json.dumps(record) + "\n")
            out.flush()  # each project as it finishes: an interrupted run goes on from the next one
            records.append(record)
            progress.console.print(" | ".join(str(record[k]) for k in ("slug", "system", "half", "outcome",
                                                                          "tests", "human", "seconds", "detail")))
            progress.advance(task)
    table = Table("project", "system", "half", "outcome", "passed/failed", "human count", "s", "detail",
                  title="builder on the real corpus")
    for r in records:
        table.add_row(*(str(r[k]) for k in ("slug", "system", "half", "outcome", "tests", "human", "seconds",
                                             "detail")))
    Console(stderr=True, width=200).print(table)
    report("builder: real repositories from their source artefacts", real_metrics(records))


def listing(only: list[str], half: str | None) -> None:
    """What a run would build, and where its results go (nothing fetched, nothing built)."""
    chosen = chosen_projects(only, half)
    for p in chosen:
        print(f"{p.half:9} {p.system:9} {p.slug:60} {p.test}")
    print(f"{len(chosen)} projects; results in {results_file(half)}")


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
    parser.add_argument("--half", choices=("reporting", "tuning"), help="with --real: that half of issue 50's split")
    parser.add_argument("--restart", action="store_true",
                        help="with --real: forget the results recorded for this rules version and half")
    parser.add_argument("--list", action="store_true", help="with --real: list what would be built, build nothing")
    parser.add_argument("--stop-after", type=float, metavar="S",
                        help="with --real: start no project after S seconds; print the figures of what is recorded")
    args = parser.parse_args()
    if args.real and args.list:
        listing(args.only, args.half)
    else:
        asyncio.run(real(args.agent, args.only, args.half, args.restart, args.stop_after) if args.real else main())
