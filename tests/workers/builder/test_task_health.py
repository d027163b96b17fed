"""``kiln tasks health`` on planted tasks over a built project, a real exec worker and the real compacted
``kiln.tasks.health`` topic: a task whose new test flips a coin (flaky), one whose gold patch breaks a PASS_TO_PASS
test, one whose image no longer exists and one whose image records no test command are quarantined — exactly those;
``RepositoryTasks`` stops serving exactly them and the status view counts them per source. Requests that expire
before a worker starts them (kiln's failure) are retried and leave a task unjudged, never quarantined; a run that is
run again resumes (nothing checked twice); a fixed task is released after two healthy checks; an operator's
quarantine holds through a healthy check until released.

The coin test is flagged flaky unless its ``RUNS`` draws with the gold patch all agree: 2 in 2^RUNS."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from kiln.rl.tasks import Problem, RepositoryTasks
from kiln.schemas.tasks import TaskHealth
from kiln.streams import admin
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import COMPACTED, TASK_HEALTH_TOPIC, TopicSpec
from kiln.streams.status.view import OpsView
from kiln.workers.builder import tasks as tasks_cli
from kiln.workers.builder.health import HealthReport, registry
from kiln.workers.common.swe import SWETask
from kiln.workers.common.task_health import TaskHealthBoard
from tests.workers.builder.test_task_validation import (
    BREAKS_MUL,
    GOLD,
    PASSING_BEFORE,
    TEST_COIN,
    TEST_NEG,
    calc_patch,
    diff,
)
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker

RUNS = 10
SOURCE = "demo/exec"
TEST_SQUARE = diff("tests/test_square.py", "", "from calc import square\n\n\ndef test_square():\n"
                                               "    assert square(3) == 9\n")


def _tasks(project_image: str, unique: str) -> dict[str, SWETask]:
    def task(problem: str, image: str, test_patch: str, gold: str, fail_to_pass: str, *more: str) -> SWETask:
        return SWETask(source=SOURCE, problem_id=problem, image=image, test_patch=test_patch, gold_patch=gold,
                       fail_to_pass=[fail_to_pass], pass_to_pass=[*PASSING_BEFORE, *more])
    neg = "tests.test_neg.test_neg"
    return {
        "neg": task("neg", project_image, TEST_NEG, GOLD, neg),
        "square": task("square", project_image, TEST_SQUARE, calc_patch("\n\ndef square(a):\n    return a * a\n"),
                       "tests.test_square.test_square"),
        # Planted: validated when the coin happened to agree; its draws now differ between runs.
        "coin": task("coin", project_image, TEST_NEG + TEST_COIN, GOLD, neg, "tests.test_coin.test_coin"),
        # Planted: the gold patch breaks mul, a PASS_TO_PASS test, in every run.
        "mul": task("mul", project_image, TEST_NEG, BREAKS_MUL, neg),
        # Planted: an image that no longer exists, and one that records no test command.
        "gone": task("gone", f"kiln/health-gone-{unique}:1", TEST_NEG, GOLD, neg),
        "untestable": task("untestable", "kiln/base:latest", TEST_NEG, GOLD, neg),
    }


def _write(path: Path, *tasks: SWETask) -> Path:
    path.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    return path


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(tasks_cli.app, list(args), env={"COLUMNS": "200"})


def _health(path: Path, *options: str) -> HealthReport:
    result = _invoke("health", str(path), *options)
    assert result.exit_code in (0, 1), result.output
    return HealthReport.model_validate(json.loads(result.stdout))


def _served(source: RepositoryTasks) -> set[str]:
    held_out = {t.task_id for t in source.held_out()}
    assert {t.task_id for t in source.sample(200)} <= held_out
    return {t.removeprefix(f"{SOURCE}:") for t in held_out}


def _checks(outcome: str) -> float:
    return registry.get_sample_value("kiln_task_health_checks_total", {"outcome": outcome}) or 0.0


def test_health_quarantines_exactly_the_planted_tasks(stage_topics: Callable[..., KilnSettings], project_image: str,
                                                      tmp_path: Path, unique: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    settings = stage_topics(("exec.requests", 4))
    admin.create_topics(settings, [TopicSpec(TASK_HEALTH_TOPIC, 1, COMPACTED)])
    monkeypatch.setattr(tasks_cli, "get_settings", lambda: settings)
    for name, value in {"RUNS": str(RUNS), "RUNS_WITHOUT_FIX": "1", "CONCURRENCY": "4", "RETRY_BACKOFF_S": "0",
                        "INFRA_ATTEMPTS": "2"}.items():
        monkeypatch.setenv(f"KILN_BUILD_HEALTH_{name}", value)
    tasks = _tasks(project_image, unique)
    path = _write(tmp_path / "tasks.jsonl", *tasks.values())
    board = TaskHealthBoard(settings, refresh_s=0)
    source = RepositoryTasks(SOURCE, project_image, [
        Problem(problem_id=t.problem_id, statement="Fix it.", test_patch=t.test_patch, fail_to_pass=t.fail_to_pass,
                pass_to_pass=t.pass_to_pass) for t in tasks.values()], health=board)
    planted = {"coin": "flaky", "mul": "gold_fails", "gone": "image_does_not_start",
               "untestable": "image_does_not_start"}
    with exec_worker(settings, tmp_path / "locks") as worker:
        worker.wait_assigned()

        # kiln's failure: each run's request expires before a worker may start it; tried twice, then unjudged.
        with monkeypatch.context() as m:
            m.setenv("KILN_BUILD_HEALTH_WAIT_S", "0.001")
            m.setenv("KILN_BUILD_HEALTH_TIMEOUT_S", "0.001")
            m.setenv("KILN_BUILD_HEALTH_RUNS_WITHOUT_FIX", "0")
            expired = _health(_write(tmp_path / "neg.jsonl", tasks["neg"]), "--runs", "1")
        assert (expired.unjudged, expired.judged, expired.retried_runs, expired.quarantined) == (
            [f"{SOURCE}:neg"], 0, 1, {}), expired
        before = board.records()[f"{SOURCE}:neg"]
        assert (before.status, before.checked_at, before.infra_failures) == ("unchecked", None, 1), before
        assert "RequestExpired" in before.infra_detail
        assert _served(source) == set(tasks)  # unchecked is served

        report = _health(path)
        assert sorted(report.newly_quarantined) == sorted(f"{SOURCE}:{p}" for p in planted), report
        assert (report.judged, report.unjudged, report.healthy, report.quarantined) == (
            6, [], 2, {"flaky": 1, "gold_fails": 1, "image_does_not_start": 2}), report
        records = {r.task_id.removeprefix(f"{SOURCE}:"): r for r in board.records().values()}
        assert {p: (r.status, r.reason) for p, r in records.items()} == {
            **{p: ("quarantined", reason) for p, reason in planted.items()},
            "neg": ("healthy", None), "square": ("healthy", None)}
        for healthy in ("neg", "square"):
            assert (records[healthy].gold_passed_runs, records[healthy].runs, records[healthy].tests,
                    records[healthy].infra_failures) == (RUNS, RUNS, [], 0)
        coin = records["coin"].tests[0]
        assert (coin.name, coin.contract, coin.runs) == ("tests.test_coin.test_coin", "pass_to_pass", RUNS)
        assert 0 < coin.failed_runs < RUNS and records["coin"].gold_passed_runs == RUNS - coin.failed_runs
        assert [(t.name, t.failed_runs) for t in records["mul"].tests] == [("tests.test_calc.test_mul", RUNS)]
        assert records["gone"].image_start_failures == RUNS + 1 and "not available" in records["gone"].detail
        assert "records no test command" in records["untestable"].detail
        assert _served(source) == {"neg", "square"}
        assert _checks("image_does_not_start") >= 2 and _checks("unjudged") >= 1

        # Run again within KILN_BUILD_HEALTH_FRESH_S: every task was judged, none is checked twice.
        ran = registry.get_sample_value("kiln_task_health_runs_total", {"side": "gold", "result": "ran"})
        with monkeypatch.context() as m:
            m.setenv("KILN_BUILD_HEALTH_FRESH_S", "3600")
            resumed = _health(path)
        assert (resumed.skipped, resumed.judged, resumed.newly_quarantined) == (6, 0, []), resumed
        assert registry.get_sample_value("kiln_task_health_runs_total", {"side": "gold", "result": "ran"}) == ran

        # mul's gold patch fixed: quarantined after one healthy check, released by the second.
        fixed = _write(tmp_path / "fixed.jsonl", tasks["mul"].model_copy(update={"gold_patch": GOLD}))
        first, second = _health(fixed, "--runs", "2"), _health(fixed, "--runs", "2")
        assert (first.released, first.quarantined, second.released) == ([], {"gold_fails": 1}, [f"{SOURCE}:mul"])
        assert _served(source) == {"neg", "square", "mul"}

        # An operator's quarantine: held through a healthy check, lifted by release.
        assert _invoke("quarantine", f"{SOURCE}:square", "--note", "its tests read the answer").exit_code == 0
        assert _served(source) == {"neg", "mul"}
        held = _health(_write(tmp_path / "square.jsonl", tasks["square"]), "--runs", "2")
        assert held.quarantined == {"operator": 1} and held.released == []
        assert _invoke("release", f"{SOURCE}:square").exit_code == 0
        assert _served(source) == {"neg", "square", "mul"}

    shown = _invoke("board", "--all", "--json")
    final = {r.task_id.removeprefix(f"{SOURCE}:"): r for r in map(TaskHealth.model_validate_json,
                                                                  shown.stdout.splitlines())}
    assert {p: r.status for p, r in final.items()} == {"neg": "healthy", "square": "healthy", "mul": "healthy",
                                                        "coin": "quarantined", "gone": "quarantined",
                                                        "untestable": "quarantined"}
    assert final["square"].healthy_checks == 0 and final["mul"].healthy_checks == 2
    view = OpsView(settings).start()
    try:
        assert view.caught_up.wait(30)
        assert view.task_sources() == {SOURCE: {"tasks": 6, "healthy": 3, "quarantined": 3, "unchecked": 0,
                                                "reasons": {"flaky": 1, "image_does_not_start": 2},
                                                "kiln_failures": 0, "healthy_share": 0.5}}
    finally:
        view.stop()
