"""Repository tasks validated on real commits: for upstream repositories of projects of the real corpus
(``bench/corpus/projects.toml``), a commit that changes code and tests is one task — the repository at the commit's
parent, the commit's changes to test files the test patch, its other changes the gold patch, its subject the
problem statement. Each repository is ingested through Saucer from a local clone of its mirror, each parent built
by the builder, each task validated by ``kiln tasks validate``'s code (exec ``run_once`` through a broker, two runs
each way, flaky tests dropped).

Selection rule, fixed before any task was validated (``--select`` applies it and rewrites
``bench/corpus/tasks.toml``; the bench itself only reads that file): per repository in ``REPOSITORIES``, walk the
non-merge commits reachable from the mirror's HEAD, newest first (``git log --no-merges``), and take the first
``PER_REPOSITORY`` whose diff against its parent

- changes at least one test source file (a path ``bench.corpus.TEST_MARKERS`` calls a test, with a source suffix),
- changes at least one code file: a source file that is no test, outside documentation folders, and not build or
  test plumbing (``setup.py``, ``noxfile.py``, ``conftest.py``, docs' ``conf.py``),
- changes at most ``MAX_FILES`` files and ``MAX_LINES`` lines (added + deleted), and no binary file.

Mirrors are bare git repositories at ``$KILN_TASK_MIRRORS/<owner>+<name>/repo`` (default ``/work/.mirror``); a
repository whose mirror is missing is listed with how to get it, its tasks not counted.

Prints ``tasks_valid_fraction`` (valid tasks / tasks tried), ``task_validate_s`` (mean seconds of the validation
runs per validated task), ``task_total_s`` (mean seconds per task with its build), ``tasks_total``, and per task
its FAIL_TO_PASS / PASS_TO_PASS sizes or its failure class (``swe.TaskFailure``: build failed, patch does not
apply, tests not usable, FAIL_TO_PASS empty, FAIL_TO_PASS only flaky) and why.
Usage: python -m bench.tasks [--select] [--only OWNER/NAME ...] [--budget-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
import tomllib
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rich.console import Console
from rich.table import Table

from bench.common import broker, report
from bench.corpus import TEST_MARKERS
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams import admin
from kiln.streams.blobstore import FileBlobStore, open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.errors import ClientError
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.stage import TopicSpec
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.builder.tasks import validate
from kiln.workers.common.containers import Limits, docker_client
from kiln.workers.exec.client import ExecClient

MANIFEST = Path(__file__).parent / "corpus" / "tasks.toml"
MIRRORS = Path(os.environ.get("KILN_TASK_MIRRORS", "/work/.mirror"))
# Upstreams of the corpus's Python projects, in the corpus's order.
REPOSITORIES = ["pypa/packaging", "benjaminp/six", "pytoolz/toolz", "more-itertools/more-itertools",
                "pallets/markupsafe", "kjd/idna", "pytest-dev/pluggy", "tartley/colorama"]
PER_REPOSITORY = 2
MAX_FILES, MAX_LINES = 12, 400
SOURCE_SUFFIXES = {".py", ".pyi", ".go", ".rs", ".c", ".h", ".js", ".mjs", ".ts"}
DOC_DIRS = {"doc", "docs", "documentation", "examples"}
PLUMBING = {"setup.py", "noxfile.py", "conftest.py"}


@dataclass(frozen=True)
class Task:
    repository: str
    sha: str
    subject: str

    @property
    def label(self) -> str:
        return f"{self.repository}@{self.sha[:10]}"


def mirror(repository: str) -> Path:
    return MIRRORS / repository.replace("/", "+") / "repo"


def missing_mirror(repository: str) -> str:
    return (f"no mirror of {repository} at {mirror(repository)}: get one with `git clone --bare "
            f"https://github.com/{repository} {mirror(repository)}` (or point KILN_TASK_MIRRORS at a folder of them)")


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", f"--git-dir={repo}", *args], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()[-500:]}")
    return done.stdout


def is_test(path: str) -> bool:
    return TEST_MARKERS.search(path) is not None


def is_code(path: str) -> bool:
    parts = PurePosixPath(path)
    return (parts.suffix in SOURCE_SUFFIXES and not is_test(path) and parts.name not in PLUMBING
            and not DOC_DIRS & {p.lower() for p in parts.parts[:-1]})


def selected(numstat: list[tuple[str, str, str]]) -> bool:
    """The rule's test on one commit's ``git log --numstat`` rows (added, deleted, path)."""
    if len(numstat) > MAX_FILES or any(a == "-" for a, _, _ in numstat):  # "-": a binary file
        return False
    paths = [p for _, _, p in numstat]
    return (sum(int(a) + int(d) for a, d, _ in numstat) <= MAX_LINES
            and any(is_test(p) and PurePosixPath(p).suffix in SOURCE_SUFFIXES for p in paths)
            and any(is_code(p) for p in paths))


def select(repository: str) -> list[Task]:
    """The newest ``PER_REPOSITORY`` commits of the repository's mirror that the rule selects."""
    log = git(mirror(repository), "log", "--no-merges", "--no-renames", "--numstat", "--format=%x00%H%x01%s", "HEAD")
    tasks = []
    for entry in log.split("\0")[1:]:
        head, _, body = entry.partition("\n")
        sha, _, subject = head.partition("\x01")
        rows = [line.split("\t", 2) for line in body.splitlines() if line.strip()]
        if selected([(r[0], r[1], r[2]) for r in rows]):
            tasks.append(Task(repository, sha, subject[:100]))
            if len(tasks) == PER_REPOSITORY:
                break
    return tasks


def write_manifest(tasks: list[Task]) -> None:
    lines = ["# Repository tasks from real commits (bench/tasks.py; its docstring states the selection rule, applied",
             "# by `python -m bench.tasks --select` to the mirrors as fetched on 2026-11-26).", ""]
    for t in tasks:
        lines += ["[[task]]", f"repository = {json.dumps(t.repository)}", f"sha = {json.dumps(t.sha)}",
                  f"subject = {json.dumps(t.subject)}", ""]
    MANIFEST.write_text("\n".join(lines))


def manifest() -> list[Task]:
    return [Task(**t) for t in tomllib.loads(MANIFEST.read_text())["task"]]


def patches(repo: Path, sha: str) -> tuple[str, str]:
    """(test patch, gold patch): the commit's diff against its parent, split by path."""
    paths = git(repo, "diff", "--no-renames", "--name-only", f"{sha}^", sha).splitlines()
    tests, rest = [p for p in paths if is_test(p)], [p for p in paths if not is_test(p)]

    def diff(chosen: list[str]) -> str:
        return git(repo, "diff", "--no-renames", "--binary", f"{sha}^", sha, "--", *chosen) if chosen else ""

    return diff(tests), diff(rest)


async def main(only: list[str], budget_s: float) -> None:
    tasks = [t for t in manifest() if not only or any(o in (t.repository, t.label) for o in only)]
    deadline = time.monotonic() + budget_s
    missing = sorted({t.repository for t in tasks if not (mirror(t.repository) / "HEAD").is_file()})
    for repository in missing:
        print(f"SKIPPED {missing_mirror(repository)}", flush=True)
    tasks = [t for t in tasks if t.repository not in missing]
    if not tasks:
        raise SystemExit("no task has a mirror: nothing to validate")
    run_steps(COMPONENT_STEPS["docker"])
    client = docker_client()
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    topics = [TopicSpec("exec.requests", 4), TopicSpec("exec.requests.dlq", 1), TopicSpec("kiln.results", 4)]
    admin.create_topics(settings, topics)
    rows: list[tuple[str, ...]] = []
    outcomes: Counter[str] = Counter()
    validate_s: list[float] = []
    total_s: list[float] = []
    limits = Limits(memory_bytes=2 << 30, cpus=2, pids=1024, timeout_s=900)
    bases = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
            worker = WorkerProcess("exec", settings, "exec.requests", slots=4, env={
                "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_EXEC_LOCK_DIR": str(root / "locks"),
                "KILN_METRICS_PORT": str(free_port())})
            try:
                worker.wait_assigned()
                # A large suite's result comes back as a claim check on the store the worker writes to.
                async with KilnClient(settings, f"bench-{uuid.uuid4().hex[:6]}",
                                      blob_store=open_blob_store(settings)) as kiln:
                    execs = ExecClient(kiln)
                    ingested: set[str] = set()
                    for task in tasks:
                        started = time.monotonic()
                        if started > deadline:  # a shared machine's time: listed, not counted
                            rows.append((task.label, task.subject[:40], "not run", "", "", "", "--budget-s spent"))
                            continue
                        name = f"tasks/{task.repository.replace('/', '-')}"
                        if task.repository not in ingested:
                            # The default branch's history only (the mirror also holds every pull request's refs).
                            clone = root / "clones" / f"{task.repository.replace('/', '+')}.git"
                            await asyncio.to_thread(subprocess.run, ["git", "clone", "-q", "--bare", "--single-branch",
                                                    str(mirror(task.repository)), str(clone)], check=True, timeout=600)
                            event = await ingest(IngestRequest(name=name, location=str(clone)), name, store,
                                                 root / "work")
                            if event.status == "failed":
                                raise RuntimeError(f"ingest of {task.repository}: {event.reason}: {event.detail}")
                            ingested.add(task.repository)
                        test_patch, gold_patch = patches(mirror(task.repository), task.sha)
                        built = await build_revision(BuildRequest(repository=name, revision=f"{task.sha}^"), store,
                                                     client, bases, root / "work", limits)
                        if not built.usable or not built.image:
                            outcomes["build_failed"] += 1
                            total_s.append(time.monotonic() - started)
                            rows.append((task.label, task.subject[:40], "build_failed", "", "", "",
                                         f"{built.failure}: {(built.detail or '')[-80:]}"))
                            continue
                        try:
                            result = await validate(execs, built.image, test_patch, gold_patch, runs=2)
                        except ClientError as e:  # the broker, not the task: listed, not counted
                            rows.append((task.label, task.subject[:40], "not run", "", "", "", str(e)[:90]))
                            print(f"task {task.label}: not run: {e}", flush=True)
                            continue
                        outcomes[result.failure or "valid"] += 1
                        validate_s.append(result.seconds)
                        total_s.append(time.monotonic() - started)
                        rows.append((task.label, task.subject[:40], result.failure or "valid",
                                     str(len(result.fail_to_pass)), str(len(result.pass_to_pass)),
                                     str(len(result.flaky)), f"{result.seconds:.0f} s; {result.reason[:90]}"))
                        print(f"task {task.label}: {rows[-1][2:]}", flush=True)
            finally:
                worker.stop()
    finally:
        admin.delete_topics(settings, [settings.topic(t.name) for t in topics])
    table = Table("task", "subject", "outcome", "FAIL_TO_PASS", "PASS_TO_PASS", "flaky", "detail",
                  title="repository tasks from real commits")
    for row in rows:
        table.add_row(*row)
    Console(stderr=True, width=220).print(table)
    total = len(total_s)
    report("tasks: real commits validated fail-to-pass", {
        "tasks_valid_fraction": round(outcomes["valid"] / max(1, total), 3), "tasks_total": float(total),
        "tasks_valid": float(outcomes["valid"]),
        "repositories": float(len({t.repository for t in tasks})),
        "task_validate_s": round(sum(validate_s) / max(1, len(validate_s)), 1),
        "task_total_s": round(sum(total_s) / max(1, total), 1)},
        {"outcomes": ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--select", action="store_true", help="apply the selection rule to every repository's "
                                                              "mirror and rewrite bench/corpus/tasks.toml")
    parser.add_argument("--only", nargs="*", default=[], help="validate these repositories' (owner/name) or tasks' "
                                                              "(owner/name@sha10) only")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no task after this many "
                                                                             "seconds (the rest listed as not run)")
    args = parser.parse_args()
    if args.select:
        for repository in [r for r in REPOSITORIES if not (mirror(r) / "HEAD").is_file()]:
            print(f"SKIPPED {missing_mirror(repository)}")
        write_manifest([t for r in REPOSITORIES if (mirror(r) / "HEAD").is_file() for t in select(r)])
        print(f"wrote {MANIFEST}")
    else:
        asyncio.run(main(args.only, args.budget_s))
