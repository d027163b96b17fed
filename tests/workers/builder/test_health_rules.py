"""The rules of ``kiln tasks health`` on given runs, without Docker: which runs quarantine a task and why, which leave
it unjudged (kiln's failures), and how a record moves between checks and operator commands. The same rules on real
images, a real exec worker and the real topic: ``test_task_health.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.schemas.tasks import TaskHealth
from kiln.workers.builder.errors import TaskFileError
from kiln.workers.builder.health import Finding, Run, judge, load_tasks, next_record, operator_record
from kiln.workers.common.swe import SWETask

TASK = SWETask(source="demo/exec", problem_id="neg", image="kiln/demo:1", test_patch="+t", gold_patch="+g",
               fail_to_pass=["t.neg"], pass_to_pass=["t.add", "t.mul"])
ALL = {"t.neg", "t.add", "t.mul"}


def gold(*passed: set[str] | str) -> list[Run]:
    return [Run(True, passed=p) for p in passed]


def before(*passed: set[str] | str) -> list[Run]:
    return [Run(False, passed=p) for p in passed]


def test_a_task_whose_gold_runs_all_pass_is_healthy() -> None:
    found = judge(TASK, gold(ALL, ALL, ALL) + before({"t.add", "t.mul"}), 0.0)
    assert (found.verdict, found.tests, found.gold_passed_runs, found.runs, found.runs_without_fix) == (
        "healthy", [], 3, 3, 1)


def test_a_test_failing_in_some_gold_runs_is_flaky_past_the_threshold() -> None:
    runs = gold(ALL, ALL - {"t.mul"}, ALL, ALL)
    found = judge(TASK, runs, 0.0)
    assert found.verdict == "flaky" and found.gold_passed_runs == 3
    assert [(t.name, t.contract, t.failed_runs, t.runs) for t in found.tests or []] == [("t.mul", "pass_to_pass", 1, 4)]
    assert "t.mul failed in 1 of 4 runs" in found.detail
    assert judge(TASK, runs, 0.25).verdict == "healthy"  # one in four is not more than a quarter


def test_a_test_failing_in_every_gold_run_means_the_gold_patch_no_longer_passes() -> None:
    found = judge(TASK, gold(ALL - {"t.neg"}, ALL - {"t.neg", "t.mul"}), 0.5)
    assert found.verdict == "gold_fails" and found.detail.endswith("t.neg"), found


def test_runs_without_trusted_results_fail_every_contract_test() -> None:
    """A run whose report kiln does not trust (no results, a forged-looking report) is a run the swe reward scores 0:
    all of them is tests_not_usable, some of them flaky."""
    untrusted = "the run failed but its report shows no failing test"
    assert judge(TASK, gold(untrusted, "no test results"), 0.0).verdict == "tests_not_usable"
    found = judge(TASK, gold(ALL, untrusted), 0.0)
    assert found.verdict == "flaky" and {t.failed_runs for t in found.tests or []} == {1}


def test_a_fail_to_pass_test_passing_without_the_fix_is_quarantined() -> None:
    found = judge(TASK, gold(ALL, ALL) + before(ALL), 0.0)
    assert found.verdict == "passes_without_fix" and found.tests and found.tests[0].passed_without_fix == 1
    assert judge(TASK, gold(ALL, ALL) + before("no test results"), 0.0).verdict == "healthy"


def test_image_failures_quarantine_only_when_the_image_started_nowhere() -> None:
    missing = [Run(True, failure="image_does_not_start", detail="ImageUnavailable: gone")] * 3
    found = judge(TASK, missing, 0.0)
    assert (found.verdict, found.image_start_failures) == ("image_does_not_start", 3)
    # Started in one run: the others ran on a worker without the image (kiln's failure), nothing judged.
    mixed = judge(TASK, missing[:2] + gold(ALL), 0.0)
    assert (mixed.verdict, mixed.infra_failures) == (None, 2)
    beside_kiln = judge(TASK, [*missing[:1], Run(True, failure="infrastructure", detail="RequestExpired")], 0.0)
    assert beside_kiln.verdict is None


def test_kiln_failures_leave_a_task_unjudged_whatever_the_other_runs_say() -> None:
    lost = Run(True, failure="infrastructure", detail="ResultLost: no result")
    found = judge(TASK, [*gold(ALL - {"t.neg"}, ALL - {"t.neg"}), lost], 0.0)
    assert (found.verdict, found.infra_failures) == (None, 1) and "ResultLost" in found.infra_detail
    patch = Run(True, failure="patch_does_not_apply", detail="the gold patch does not apply")
    assert judge(TASK, [lost, patch], 0.0).verdict == "patch_does_not_apply"  # deterministic: judged anyway


def record(status: str, reason: str | None = None, healthy_checks: int = 0) -> TaskHealth:
    return TaskHealth.model_validate({"task_id": TASK.task_id, "source": TASK.source, "status": status,
                                      "reason": reason, "updated_at": 1.0, "checked_at": 1.0,
                                      "healthy_checks": healthy_checks})


def test_a_quarantine_is_lifted_after_enough_consecutive_healthy_checks() -> None:
    healthy = Finding("healthy", runs=3, gold_passed_runs=3)
    first = next_record(record("quarantined", "flaky"), TASK, healthy, release_after=2, now=10.0)
    assert (first.status, first.reason, first.healthy_checks, first.checked_at) == ("quarantined", "flaky", 1, 10.0)
    second = next_record(first, TASK, healthy, release_after=2, now=20.0)
    assert (second.status, second.reason, second.healthy_checks, second.detail) == ("healthy", None, 2, "")
    again = next_record(second, TASK, Finding("gold_fails", detail="t.neg"), release_after=2, now=30.0)
    assert (again.status, again.reason, again.healthy_checks) == ("quarantined", "gold_fails", 0)
    new = next_record(None, TASK, healthy, release_after=2, now=5.0)
    assert (new.status, new.task_id, new.source, new.image) == ("healthy", "demo/exec:neg", "demo/exec", "kiln/demo:1")


def test_an_unjudged_check_keeps_the_status_and_its_last_judgement() -> None:
    kiln_failed = Finding(None, infra_failures=4, infra_detail="4 of 4 runs failed for kiln's reasons")
    kept = next_record(record("quarantined", "flaky"), TASK, kiln_failed, release_after=1, now=50.0)
    assert (kept.status, kept.reason, kept.checked_at, kept.infra_failures, kept.infra_at) == (
        "quarantined", "flaky", 1.0, 4, 50.0)
    fresh = next_record(None, TASK, kiln_failed, release_after=1, now=50.0)
    assert (fresh.status, fresh.checked_at) == ("unchecked", None)


def test_an_operator_quarantine_holds_until_released() -> None:
    held = operator_record(record("healthy"), TASK.task_id, "quarantine", "hackable: tests read the answer", 2.0)
    assert (held.status, held.reason, held.operator_note) == ("quarantined", "operator", "hackable: tests read "
                                                                                        "the answer")
    for _ in range(3):
        held = next_record(held, TASK, Finding("healthy", runs=2, gold_passed_runs=2), release_after=1, now=3.0)
    assert (held.status, held.reason, held.healthy_checks) == ("quarantined", "operator", 3)
    released = operator_record(held, TASK.task_id, "release", "fixed upstream", 4.0)
    assert (released.status, released.reason) == ("healthy", None)
    unknown = operator_record(None, "other/repo:p7", "quarantine", "bad", 5.0)
    assert (unknown.source, unknown.status) == ("other/repo", "quarantined")
    with pytest.raises(TaskFileError, match="not a task id"):
        operator_record(None, "no-colon", "quarantine", "bad", 5.0)
    with pytest.raises(TaskFileError, match="nothing to release"):
        operator_record(None, "other/repo:p8", "release", "typo", 5.0)


def test_a_task_file_names_its_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(TASK.model_dump_json() + "\n\n" + TASK.model_dump_json().replace('"fail_to_pass":["t.neg"]',
                                                                                    '"fail_to_pass":[]') + "\n")
    with pytest.raises(TaskFileError, match=r"tasks\.jsonl:3: not a task: \('fail_to_pass',\)"):
        load_tasks(path)
    path.write_text(TASK.model_dump_json() + "\n" + TASK.model_dump_json() + "\n")
    with pytest.raises(TaskFileError, match=r"tasks\.jsonl:2: task demo/exec:neg appears twice"):
        load_tasks(path)
    path.write_text(TASK.model_dump_json() + "\n")
    assert load_tasks(path) == [TASK]
