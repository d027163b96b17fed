"""Repository tasks validated on real code: for projects of the real corpus, the change between two consecutive
releases (both source artefacts fetched like the corpus, ``bench/corpus.py``) is one task — its changes to test files
the test patch, its other Python changes the gold patch — built at the older release by the builder and validated
by ``kiln tasks validate``'s code (exec ``run_once`` through a broker, two runs each way, flaky tests dropped). The
artefacts carry no VCS history, so a release-to-release change stands in for a commit; a pair whose change does not
touch both code and tests is no task and is listed, not counted.

Prints ``tasks_valid_fraction`` (valid tasks / tasks), ``task_validate_s`` (mean seconds per task, the runs only),
``tasks_total``, and per task its FAIL_TO_PASS / PASS_TO_PASS sizes or why it is not valid.
Usage: python -m bench.tasks [--only NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import tempfile
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import broker, report
from bench.corpus import TEST_MARKERS, Project, prepare
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams import admin
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.client import KilnClient
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.stage import TopicSpec
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.builder.tasks import validate
from kiln.workers.common.containers import Limits, docker_client
from kiln.workers.exec.client import ExecClient

# (name, older release, newer release): PyPI projects of the corpus, consecutive releases.
PAIRS = [("toolz", "0.12.0", "0.12.1"), ("idna", "3.6", "3.7"), ("pluggy", "1.4.0", "1.5.0"),
         ("six", "1.15.0", "1.16.0"), ("colorama", "0.4.5", "0.4.6"), ("more-itertools", "10.2.0", "10.3.0")]
# Metadata, and the version module setuptools-scm writes at build time (the built tree has its own).
SKIP = ("/.git/", "PKG-INFO", ".egg-info/", "/_version.py")


def _texts(root: Path) -> dict[str, str]:
    out = {}
    for path in root.rglob("*.py"):
        rel = str(path.relative_to(root))
        if not any(s in f"/{rel}" for s in SKIP):
            out[rel] = path.read_text(errors="replace")
    return out


def release_patches(old: Path, new: Path) -> tuple[str, str]:
    """(test patch, gold patch): the unified diffs of the Python files that changed between two releases."""
    before, after = _texts(old), _texts(new)
    test, gold = [], []
    for rel in sorted(set(before) | set(after)):
        a, b = before.get(rel, ""), after.get(rel, "")
        if a == b:
            continue
        lines = difflib.unified_diff(a.splitlines(True), b.splitlines(True),
                                     f"a/{rel}" if rel in before else "/dev/null",
                                     f"b/{rel}" if rel in after else "/dev/null")
        # A last line without a newline is marked as git marks it.
        diff = "".join(ln if ln.endswith("\n") else f"{ln}\n\\ No newline at end of file\n" for ln in lines)
        (test if TEST_MARKERS.search(rel) else gold).append(diff)
    return "".join(test), "".join(gold)


async def main(only: list[str]) -> None:
    run_steps(COMPONENT_STEPS["docker"])
    client = docker_client()
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    topics = [TopicSpec("exec.requests", 4), TopicSpec("exec.requests.dlq", 1), TopicSpec("kiln.results", 4)]
    admin.create_topics(settings, topics)
    rows: list[tuple[str, ...]] = []
    valid, seconds = 0, []
    limits = Limits(memory_bytes=2 << 30, cpus=2, pids=1024, timeout_s=900)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
            worker = WorkerProcess("exec", settings, "exec.requests", slots=4, env={
                "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_EXEC_LOCK_DIR": str(root / "locks"),
                "KILN_METRICS_PORT": str(free_port())})
            try:
                worker.wait_assigned()
                async with KilnClient(settings, f"bench-{uuid.uuid4().hex[:6]}") as kiln:
                    execs = ExecClient(kiln)
                    for name, older, newer in [p for p in PAIRS if not only or p[0] in only]:
                        label = f"{name} {older} -> {newer}"
                        try:
                            old = prepare(Project("pypi", name, older, "python", "pytest"))
                            new = prepare(Project("pypi", name, newer, "python", "pytest"))
                        except RuntimeError as e:
                            rows.append((label, "not fetched", "", "", "", str(e)[:70]))
                            continue
                        test_patch, gold_patch = release_patches(old, new)
                        if not test_patch or not gold_patch:
                            rows.append((label, "no task", "", "", "", "the change does not touch both code "
                                                                       "and tests"))
                            continue
                        os.environ["KILN_INGEST_LOCAL_ROOTS"] = json.dumps([tempfile.gettempdir(),
                                                                            str(old.parent)])
                        await ingest(IngestRequest(name=f"tasks/{name}", location=str(old)), name, store,
                                     root / "work")
                        event = await build_revision(BuildRequest(repository=f"tasks/{name}"), store, client,
                                                     BaseImages("kiln/base:latest", "kiln/toolchain:latest"),
                                                     root / "work", limits)
                        if not event.usable or not event.image:
                            rows.append((label, "not valid", "", "", "", f"build: {event.failure}"))
                            seconds.append(0.0)
                            continue
                        result = await validate(execs, event.image, test_patch, gold_patch, runs=2)
                        valid += result.valid
                        seconds.append(result.seconds)
                        rows.append((label, "valid" if result.valid else "not valid", str(len(result.fail_to_pass)),
                                     str(len(result.pass_to_pass)), str(len(result.flaky)),
                                     f"{result.seconds:.0f} s" + (f"; {result.reason[:60]}" if result.reason else "")))
            finally:
                worker.stop()
    finally:
        admin.delete_topics(settings, [settings.topic(t.name) for t in topics])
    table = Table("task (release change)", "outcome", "FAIL_TO_PASS", "PASS_TO_PASS", "flaky", "detail",
                  title="repository tasks from real releases")
    for row in rows:
        table.add_row(*row)
    Console(stderr=True, width=200).print(table)
    total = len(seconds)
    report("tasks: real release changes validated fail-to-pass", {
        "tasks_valid_fraction": round(valid / max(1, total), 3), "tasks_total": float(total),
        "task_validate_s": round(sum(seconds) / max(1, total), 1)})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="these projects (by name) only")
    asyncio.run(main(parser.parse_args().only))
