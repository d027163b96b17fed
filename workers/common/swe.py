"""The SWE-task contract (SWE-bench, SWE-smith, SWE-Gym, R2E-Gym): for a task — a revision, a test patch, a gold
patch — FAIL_TO_PASS are the tests that fail before the gold patch and pass after it, PASS_TO_PASS those that pass
both ways; both read from per-test results of several runs each way, a test whose outcome changes between runs of
the same side dropped as flaky. A task is valid only when FAIL_TO_PASS is not empty and every run gave per-test
results kiln trusts (``reports.unusable_reason``). A reward on the task checks exactly these two lists."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.reports import TestReport
from kiln.workers.common.reports import unusable_reason

# Why a task is not valid, one class each: its revision does not build usably; a patch does not apply to it; a run
# gave no per-test results kiln trusts; no test fails before the gold patch and passes after it; or only tests that
# were dropped as flaky would have.
TaskFailure = Literal["build_failed", "patch_does_not_apply", "tests_not_usable", "fail_to_pass_empty",
                      "fail_to_pass_flaky"]


class TaskValidation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    valid: bool
    failure: TaskFailure | None = Field(None, description="The class of ``reason`` (None when the task is valid).")
    reason: str = Field("", description="Why the task is not valid (empty when it is).")
    fail_to_pass: list[str] = Field(default_factory=list)
    pass_to_pass: list[str] = Field(default_factory=list)
    flaky: list[str] = Field(default_factory=list, description="Tests whose outcome changed between runs of one "
                                                               "side: in neither list.")
    runs: int = Field(0, description="Runs on each side (before and after the gold patch).")
    seconds: float = 0.0


def task_id(source: str, problem_id: str) -> str:
    """How a repository task is named wherever its health is looked up: ``<source>:<problem id>``."""
    return f"{source}:{problem_id}"


class SWETask(BaseModel):
    """A validated repository task with what re-checking it needs (its gold patch): one JSON line of the task file
    ``kiln tasks health`` reads (``kiln tasks validate --save`` appends one)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(min_length=1, max_length=500, description="The repository (``RepositoryTasks``' "
                                                                  "``repository``).")
    problem_id: str = Field(min_length=1, max_length=400)
    image: str = Field(min_length=1, max_length=1000, description="The revision's built image.")
    test_patch: str
    gold_patch: str = Field(min_length=1)
    fail_to_pass: list[str] = Field(min_length=1)
    pass_to_pass: list[str] = Field(default_factory=list)

    @property
    def task_id(self) -> str:
        return task_id(self.source, self.problem_id)


def _passed(report: TestReport) -> set[str]:
    return {c.name for c in report.cases if c.outcome == "passed"}


def _always(runs: list[set[str]]) -> set[str]:
    return set.intersection(*runs) if runs else set()


def _ever(runs: list[set[str]]) -> set[str]:
    return set().union(*runs)


def split(before: list[TestReport | None], after: list[TestReport | None]) -> TaskValidation:
    """FAIL_TO_PASS / PASS_TO_PASS from the runs with the test patch alone (``before``) and with the test and gold
    patches (``after``). A test absent from a run did not pass in it (a test the test patch adds may not even be
    collected before the fix). Skipped tests pass neither way."""
    runs = max(len(before), len(after))
    for side, reports in (("before", before), ("after", after)):
        if not reports:
            return TaskValidation(valid=False, failure="tests_not_usable", reason=f"no run {side} the gold patch",
                                  runs=runs)
        for i, report in enumerate(reports):
            if report is None:
                return TaskValidation(valid=False, failure="tests_not_usable",
                                      reason=f"run {i + 1} {side} the gold patch gave no test results", runs=runs)
            problem = unusable_reason(report)
            # Before the fix every test may fail (the new tests' module does not even import): only the per-test
            # results and their agreement with the runner's summary matter there.
            if problem is not None and (side == "after" or problem[0] == "tests_not_itemised"):
                return TaskValidation(valid=False, failure="tests_not_usable",
                                      reason=f"run {i + 1} {side} the gold patch: {problem[1]}", runs=runs)
    passes_before = [_passed(r) for r in before if r is not None]
    passes_after = [_passed(r) for r in after if r is not None]
    named = {c.name for r in [*before, *after] if r is not None for c in r.cases}
    flaky = {t for side in (passes_before, passes_after) for t in _ever(side) - _always(side)}
    passed_before = _always(passes_before) - flaky
    never_before = named - _ever(passes_before) - flaky
    passed_after = _always(passes_after) - flaky
    fail_to_pass, pass_to_pass = sorted(never_before & passed_after), sorted(passed_before & passed_after)
    if fail_to_pass:
        return TaskValidation(valid=True, fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass, flaky=sorted(flaky),
                              runs=runs)
    # A flaky test that never passed in some run before and passed in some run after would have been FAIL_TO_PASS.
    flaky_fix = sorted(t for t in flaky if t not in _always(passes_before) and t in _ever(passes_after))
    return TaskValidation(valid=False, failure="fail_to_pass_flaky" if flaky_fix else "fail_to_pass_empty",
                          reason="no test fails before the gold patch and passes after it (FAIL_TO_PASS is empty)"
                          + (f"; flaky, dropped: {', '.join(flaky_fix[:5])}" if flaky_fix else ""),
                          pass_to_pass=pass_to_pass, flaky=sorted(flaky), runs=runs)
