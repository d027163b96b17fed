"""``kiln tasks health``: validated repository tasks re-checked on their images, and the verdict kept on the compacted
``kiln.tasks.health`` topic (``schemas.tasks.TaskHealth``), where task sources (``RepositoryTasks``) read which tasks
not to serve and the status page each source's healthy share.

A check runs a task's tests ``health_runs`` times with its test and gold patches and ``health_runs_without_fix``
times with its test patch alone, each run an exec ``run_once`` call in a fresh sandbox (``tasks.run_tests``, as
``kiln tasks validate`` runs them), and judges them by the ``swe`` reward's own rule (``contract_passes``): a run with
the gold patch passes when every FAIL_TO_PASS and PASS_TO_PASS test passed in per-test results kiln trusts. The task
is quarantined when its image does not start, a patch no longer applies, no run gave trusted results, a contract
test failed in every gold run (the gold patch no longer passes) or in more than ``health_max_failure_share`` of them
(flaky), or a FAIL_TO_PASS test passed without the gold patch (a patch that changes nothing would score 1).

kiln's own failures never quarantine a task: a run whose exec call expired, was lost, or failed for the worker, the
engine or the broker is tried again (``health_infra_attempts``); what still fails leaves the task unjudged — its
status unchanged, the failure counted apart (``infra_failures``), the command's exit status 1. A run whose tests did
not finish in time is tried again too (a loaded worker); only one that times out in every try fails its tests. An
image missing on some workers while it started on others is kiln's failure too (a node without a local image). A
quarantine is lifted by ``health_release_after`` consecutive healthy checks, or by ``kiln tasks release``; one an
operator set (``kiln tasks quarantine``) only by ``kiln tasks release``. Each task's record is written as soon as its
check ends, so an interrupted run loses nothing, and with ``health_fresh_s`` a run skips the tasks checked since: run
again, it resumes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.tasks import QuarantineReason, TaskHealth, TestHealth
from kiln.streams.client import KilnClient
from kiln.streams.errors import ClientError, InfraError, RequestFailed
from kiln.workers.builder.errors import TaskFileError, TaskPatchFailed
from kiln.workers.builder.tasks import run_tests
from kiln.workers.common.swe import SWETask
from kiln.workers.common.task_health import TaskHealthBoard, publish_health
from kiln.workers.exec.client import ExecClient
from kiln.workers.exec.errors import ImageUnavailable
from kiln.workers.verifiers.repository import contract_passes


class TaskHealthSettings(BaseSettings):
    """``kiln tasks health``'s knobs (``KILN_BUILD_`` + field name: the builder package's one prefix)."""

    model_config = SettingsConfigDict(env_prefix="KILN_BUILD_", extra="ignore")

    health_runs: int = Field(5, ge=1, le=100, description="Runs of a task's tests with its test and gold patches per "
                                                          "check: flakiness is measured over these.")
    health_runs_without_fix: int = Field(1, ge=0, le=20, description="Runs with the test patch alone: a "
                                         "FAIL_TO_PASS test that passes in one quarantines the task.")
    health_max_failure_share: float = Field(0.0, ge=0.0, lt=1.0, description="A task is quarantined as flaky when "
                                            "one of its FAIL_TO_PASS / PASS_TO_PASS tests failed in more than this "
                                            "share of its gold runs (0: in any).")
    health_release_after: int = Field(2, ge=1, le=100, description="Consecutive healthy checks that lift a "
                                      "quarantine a check set.")
    health_concurrency: int = Field(8, ge=1, le=1024, description="Exec calls (test runs) in flight.")
    health_infra_attempts: int = Field(3, ge=1, le=20, description="Tries of a run that failed for kiln's reasons "
                                       "before the task is left unjudged.")
    health_retry_backoff_s: float = Field(5.0, ge=0.0, le=600.0, description="Wait before the second try; doubled "
                                          "for each later one.")
    health_timeout_s: float = Field(600.0, gt=0, le=3600, description="Time limit of one run's test command.")
    health_wait_s: float = Field(600.0, gt=0, description="How long one run may wait for an exec worker on top of "
                                 "its time limit (its request's deadline: not started by then, it expires).")
    health_fresh_s: float = Field(0.0, ge=0.0, description="Tasks checked within this many seconds are skipped: an "
                                  "interrupted run resumes, a schedule re-checks only stale tasks (0: check all).")
    health_metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port while ``--every`` runs "
                                     "(0: none).")


registry = CollectorRegistry()
CHECKS = Counter("kiln_task_health_checks_total", "Task checks, by outcome: healthy, a quarantine reason, or "
                 "unjudged (kiln's failure).", ["outcome"], registry=registry)
RUNS = Counter("kiln_task_health_runs_total", "Test runs of task checks, by side (gold, without_fix) and result "
               "(ran, patch_does_not_apply, image_does_not_start, infrastructure).", ["side", "result"],
               registry=registry)
RETRIES = Counter("kiln_task_health_retries_total", "Runs tried again after failing for kiln's reasons.",
                  registry=registry)
CHECK_SECONDS = Histogram("kiln_task_health_check_seconds", "Time to check one task (all its runs).",
                          buckets=(1, 5, 15, 60, 300, 900, 3600), registry=registry)
QUARANTINED = Gauge("kiln_task_health_quarantined", "Tasks of the last run's file that are quarantined.",
                    registry=registry)

RunFailure = Literal["patch_does_not_apply", "image_does_not_start", "infrastructure"]


@dataclass
class Run:
    """One run of a check: its trusted passing tests (or why its results are not trusted), or why it did not run."""

    with_fix: bool
    passed: set[str] | str = "not run"
    failure: RunFailure | None = None
    detail: str = ""
    retries: int = 0


@dataclass
class Finding:
    """What one check found: a verdict (None: kiln's failures left it unjudged) and its evidence."""

    verdict: Literal["healthy"] | QuarantineReason | None
    detail: str = ""
    runs: int = 0
    runs_without_fix: int = 0
    gold_passed_runs: int = 0
    tests: list[TestHealth] | None = None
    image_start_failures: int = 0
    infra_failures: int = 0
    infra_detail: str = ""


class HealthReport(BaseModel):
    """What one health run did."""

    tasks: int = 0
    skipped: int = Field(0, description="Checked within ``health_fresh_s``: not checked again.")
    judged: int = 0
    unjudged: list[str] = Field(default_factory=list, description="Tasks kiln's failures left unjudged.")
    healthy: int = 0
    quarantined: dict[str, int] = Field(default_factory=dict, description="Quarantined after the run, by reason.")
    newly_quarantined: list[str] = Field(default_factory=list)
    released: list[str] = Field(default_factory=list)
    retried_runs: int = 0
    seconds: float = 0.0


def load_tasks(path: Path) -> list[SWETask]:
    """The task file: one ``SWETask`` per line (blank lines ignored); ``TaskFileError`` names a bad line or a task id
    given twice."""
    tasks: list[SWETask] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = SWETask.model_validate_json(line)
        except ValidationError as e:
            raise TaskFileError(f"{path}:{number}: not a task: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") \
                from None
        if task.task_id in seen:
            raise TaskFileError(f"{path}:{number}: task {task.task_id} appears twice")
        seen.add(task.task_id)
        tasks.append(task)
    return tasks


async def _run(execs: ExecClient, task: SWETask, with_fix: bool, health: TaskHealthSettings,
               calls: asyncio.Semaphore) -> Run:
    """One run, tried again while it fails for kiln's reasons."""
    patches = {"test-patch": task.test_patch, **({"gold-patch": task.gold_patch} if with_fix else {})}
    side = "gold" if with_fix else "without_fix"
    why = ""
    for attempt in range(health.health_infra_attempts):
        if attempt:
            RETRIES.inc()
            await asyncio.sleep(health.health_retry_backoff_s * 2 ** (attempt - 1))
        try:
            async with calls:
                result = await run_tests(execs, task.image, patches, health.health_timeout_s,
                                         deadline_s=health.health_wait_s + health.health_timeout_s)
        except TaskPatchFailed as e:
            RUNS.labels(side, "patch_does_not_apply").inc()
            return Run(with_fix, failure="patch_does_not_apply", detail=str(e), retries=attempt)
        except RequestFailed as e:
            if e.error_type == ImageUnavailable.__name__:
                RUNS.labels(side, "image_does_not_start").inc()
                return Run(with_fix, failure="image_does_not_start", detail=e.reason[:500], retries=attempt)
            why = e.reason[:500]
        except (ClientError, InfraError) as e:  # expired, lost, not sent; the broker
            why = f"{type(e).__name__}: {str(e)[:500]}"
        else:
            tests = next((s for s in result.steps if s.name == "tests"), None)
            if tests is not None and tests.timed_out and attempt + 1 < health.health_infra_attempts:
                why = f"the tests did not finish within {health.health_timeout_s:g} s"
                continue  # a loaded worker, or a test that hangs: tried again; every try timing out is the task's
            RUNS.labels(side, "ran").inc()
            passed = contract_passes(result.tests, tests.exit_code if tests is not None else None)
            if tests is not None and tests.timed_out:
                passed = f"the tests did not finish within {health.health_timeout_s:g} s in {attempt + 1} tries"
            return Run(with_fix, passed=passed, retries=attempt)
    RUNS.labels(side, "infrastructure").inc()
    return Run(with_fix, failure="infrastructure", detail=why, retries=health.health_infra_attempts - 1)


def judge(task: SWETask, runs: list[Run], max_failure_share: float) -> Finding:
    """The verdict on one check's runs (see the module's docstring for the rules and their order)."""
    gold = [r for r in runs if r.with_fix]
    without = [r for r in runs if not r.with_fix]
    images = [r for r in runs if r.failure == "image_does_not_start"]
    infra = [r for r in runs if r.failure == "infrastructure"]
    started = [r for r in runs if r.failure in (None, "patch_does_not_apply")]
    found = Finding(None, runs=len(gold), runs_without_fix=len(without), image_start_failures=len(images))
    if images and not started and not infra:
        return replace(found, verdict="image_does_not_start", detail=images[0].detail)
    patch = next((r for r in runs if r.failure == "patch_does_not_apply"), None)
    if patch is not None:
        return replace(found, verdict="patch_does_not_apply", detail=patch.detail)
    if infra or images:
        # An image that started in other runs (or not at all, beside kiln's failures) is missing on some worker.
        failed = infra + images
        return replace(found, infra_failures=len(failed), infra_detail=(
            f"{len(failed)} of {len(runs)} runs failed for kiln's reasons, e.g. {failed[0].detail}")[:2000])
    contract = {**{t: "fail_to_pass" for t in task.fail_to_pass}, **{t: "pass_to_pass" for t in task.pass_to_pass}}
    passes = [r.passed for r in gold]
    trusted = [p for p in passes if not isinstance(p, str)]
    failed_runs = {t: sum(1 for p in passes if isinstance(p, str) or t not in p) for t in contract}
    without_fix = {t: sum(1 for r in without if not isinstance(r.passed, str) and t in r.passed)
                   for t in task.fail_to_pass}
    tests = sorted((TestHealth.model_validate({"name": t, "contract": c, "failed_runs": failed_runs[t],
                                               "runs": len(gold), "passed_without_fix": without_fix.get(t, 0)})
                    for t, c in contract.items() if failed_runs[t] or without_fix.get(t, 0)),
                   key=lambda h: (-h.failed_runs, -h.passed_without_fix, h.name))[:200]
    found = replace(found, tests=tests, gold_passed_runs=sum(1 for p in trusted if set(contract) <= p))
    worst = tests[0] if tests else None
    if not trusted:
        reason = next(p for p in passes if isinstance(p, str))
        return replace(found, verdict="tests_not_usable",
                       detail=f"no run with the gold patch gave per-test results kiln trusts: {reason}")
    if worst is not None and worst.failed_runs == len(gold):
        never = [h.name for h in tests if h.failed_runs == len(gold)]
        return replace(found, verdict="gold_fails", detail=f"{len(never)} contract test(s) failed in every run with "
                                                           f"the gold patch: {', '.join(never[:5])}")
    if worst is not None and worst.failed_runs / len(gold) > max_failure_share:
        flaky = [h for h in tests if h.failed_runs / len(gold) > max_failure_share]
        return replace(found, verdict="flaky", detail=", ".join(
            f"{h.name} failed in {h.failed_runs} of {h.runs} runs with the gold patch" for h in flaky[:5])
            + f" (more than {max_failure_share:g} of them)")
    early = [t for t, n in without_fix.items() if n]
    if early:
        return replace(found, verdict="passes_without_fix",
                       detail=f"FAIL_TO_PASS test(s) passed without the gold patch: {', '.join(early[:5])}")
    return replace(found, verdict="healthy")


def next_record(previous: TaskHealth | None, task: SWETask, finding: Finding, release_after: int,
                now: float) -> TaskHealth:
    """The task's record after a check: its status moves by the finding, its evidence is the finding's."""
    base = previous or TaskHealth(task_id=task.task_id, source=task.source, status="unchecked", updated_at=now)
    update: dict[str, object] = {"image": task.image, "updated_at": now, "infra_failures": finding.infra_failures}
    if finding.verdict is None:
        return base.model_copy(update={**update, "infra_detail": finding.infra_detail, "infra_at": now})
    update |= {"checked_at": now, "runs": finding.runs, "runs_without_fix": finding.runs_without_fix,
               "gold_passed_runs": finding.gold_passed_runs, "tests": finding.tests or [],
               "image_start_failures": finding.image_start_failures}
    held = base.status == "quarantined" and base.reason == "operator"
    if finding.verdict == "healthy":
        streak = base.healthy_checks + 1
        if held:
            return base.model_copy(update={**update, "healthy_checks": streak})
        if base.status == "quarantined" and streak < release_after:
            return base.model_copy(update={**update, "healthy_checks": streak, "detail": (
                f"healthy in {streak} consecutive check(s) of the {release_after} that lift the quarantine; before: "
                f"{base.detail}")[:4000]})
        return base.model_copy(update={**update, "status": "healthy", "reason": None, "detail": "",
                                       "healthy_checks": streak})
    if held:
        return base.model_copy(update={**update, "healthy_checks": 0})
    return base.model_copy(update={**update, "status": "quarantined", "reason": finding.verdict,
                                   "detail": finding.detail[:4000], "healthy_checks": 0})


def operator_record(previous: TaskHealth | None, task_id: str, action: Literal["quarantine", "release"], note: str,
                    now: float) -> TaskHealth:
    """``kiln tasks quarantine`` (held until released, whatever later checks find) or ``kiln tasks release``
    (healthy until a check finds otherwise)."""
    source, sep, _problem = task_id.partition(":")
    if previous is None and not (sep and source):
        raise TaskFileError(f"{task_id!r} is not a task id (<source>:<problem id>)")
    if previous is None and action == "release":
        raise TaskFileError(f"task {task_id} has no health record: nothing to release")
    base = previous or TaskHealth(task_id=task_id, source=source, status="unchecked", updated_at=now)
    if action == "quarantine":
        return base.model_copy(update={"status": "quarantined", "reason": "operator", "detail": note[:4000],
                                       "operator_note": note[:2000], "healthy_checks": 0, "updated_at": now})
    return base.model_copy(update={"status": "healthy", "reason": None, "detail": "", "operator_note": note[:2000],
                                   "healthy_checks": 0, "updated_at": now})


LATEST_S = 5.0
"""How old the board a check's record is made against may be: an operator's ``quarantine`` or ``release`` older
than this is never overwritten by a check that started before it."""


def _due(record: TaskHealth | None, now: float, fresh_s: float) -> bool:
    """Whether a task is checked in this run: always without ``health_fresh_s``, else unless it was judged since."""
    return fresh_s <= 0 or record is None or record.checked_at is None or now - record.checked_at >= fresh_s


async def health_run(kiln: KilnClient, tasks: list[SWETask], health: TaskHealthSettings,
                     clock: Callable[[], float] = time.time) -> HealthReport:
    """Check every task of ``tasks`` not checked within ``health_fresh_s``, each record written when its check
    ends."""
    started = time.monotonic()
    board = TaskHealthBoard(kiln.settings, refresh_s=LATEST_S)
    previous = board.records()
    now = clock()
    due = [t for t in tasks if _due(previous.get(t.task_id), now, health.health_fresh_s)]
    report = HealthReport(tasks=len(tasks), skipped=len(tasks) - len(due))
    execs = ExecClient(kiln)
    calls = asyncio.Semaphore(health.health_concurrency)
    in_flight = asyncio.Semaphore(health.health_concurrency)
    after: dict[str, TaskHealth] = {}

    async def check(task: SWETask) -> None:
        async with in_flight:
            began = time.monotonic()
            runs = list(await asyncio.gather(
                *(_run(execs, task, True, health, calls) for _ in range(health.health_runs)),
                *(_run(execs, task, False, health, calls) for _ in range(health.health_runs_without_fix))))
            finding = judge(task, runs, health.health_max_failure_share)
            # Against the latest record, not the one read at the start: an operator may have acted meanwhile.
            latest = await asyncio.to_thread(board.get, task.task_id)
            record = next_record(latest, task, finding, health.health_release_after, clock())
            await asyncio.to_thread(publish_health, kiln.settings, [record])
            CHECKS.labels(finding.verdict or "unjudged").inc()
            CHECK_SECONDS.observe(time.monotonic() - began)
            after[task.task_id] = record
            report.retried_runs += sum(r.retries for r in runs)
            if finding.verdict is None:
                report.unjudged.append(task.task_id)
            else:
                report.judged += 1

    await asyncio.gather(*(check(t) for t in due))
    for task in due:
        before = previous.get(task.task_id)
        was, now_is = (before.status if before is not None else "unchecked"), after[task.task_id].status
        if now_is == "quarantined" and was != "quarantined":
            report.newly_quarantined.append(task.task_id)
        if was == "quarantined" and now_is == "healthy":
            report.released.append(task.task_id)
    final = [r for r in (after.get(t.task_id) or previous.get(t.task_id) for t in tasks) if r is not None]
    reasons = Tally(r.reason or "?" for r in final if r.status == "quarantined")
    report.quarantined = dict(sorted(reasons.items()))
    report.healthy = sum(1 for r in final if r.status == "healthy")
    report.unjudged.sort()
    QUARANTINED.set(sum(reasons.values()))
    report.seconds = round(time.monotonic() - started, 3)
    return report
