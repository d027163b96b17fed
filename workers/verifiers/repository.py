"""The repository verifiers, each completion in an exec ``run_once`` call of its own on a builder-built image of the
repository: ``swe`` (a SWE-bench-style task: the completion's patch and the task's test patch, then the task's tests)
and ``tests`` (the completion's patch, then the image's own recorded test command: the share of its tests that
pass). Both judge code that shares the test runner's process or stdout, so both refuse a report kiln cannot trust
(``_untrusted``)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.exec import RunStep, SessionLimits
from kiln.schemas.images import REPORTS_DIR
from kiln.schemas.reports import TestReport
from kiln.schemas.rl import RolloutTask
from kiln.streams.errors import ClientError
from kiln.workers.common.errors import ReportError
from kiln.workers.common.patches import APPLY_EXCLUDES, patch_text, protected_paths
from kiln.workers.common.reports import junit, unusable_reason
from kiln.workers.verifiers.contract import PerCompletion, Verdict, VerifierContext, checked


class SWECheck(BaseModel):
    """A repository task: the completion's ``<patch>…</patch>`` is applied to a copy of the session's tree (the
    repository's built image), then ``test_patch`` (the tests that define done), then ``test_command`` decides."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    test_patch: str = ""
    test_command: str = Field("python -m pytest -q -p no:cacheprovider", description="Without FAIL_TO_PASS only.")
    timeout_s: float = Field(300.0, gt=0, le=600)
    fail_to_pass: list[str] = Field(default_factory=list, description="Tests that fail before the fix and pass "
                                    "after it (``kiln tasks validate``): with them, the image's own test command "
                                    "and per-test results decide, not ``test_command``.")
    pass_to_pass: list[str] = Field(default_factory=list, description="Tests that pass before and after the fix.")


class SWEVerifier(PerCompletion):
    """Each completion in a ``run_once`` call of its own: its patch, the task's test patch, the task's test command.
    The test command's exit status is measured by the runner's supervisor, never reported from the sandbox; a pytest
    command also writes a JUnit report, and the reward is 1 only when the run exits 0 *and* the report shows every
    test the test patch adds passing with no failure — code that ends the test process early (``os._exit(0)`` on
    import) leaves no such report. A patch that touches the tests or the test runner's configuration scores 0 unrun
    (``kiln.workers.common.patches``).

    A task with FAIL_TO_PASS (the SWE-bench contract, ``kiln.workers.common.swe``) runs the image's recorded test
    command (kiln's reporters) instead: reward 1 exactly when every FAIL_TO_PASS and PASS_TO_PASS test passes in
    per-test results kiln trusts (itemised, agreeing with the runner's summary); a run whose exit status (measured
    outside the sandbox) failed while its report shows no failing test scores 0, as a forged report would."""

    def __init__(self, context: VerifierContext) -> None:
        super().__init__(context)
        self._calls = asyncio.Semaphore(context.exec_calls)

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        check = checked(SWECheck, task)
        return list(await asyncio.gather(*(self._attempt(check, c) for c in completions)))

    async def _attempt(self, check: SWECheck, completion: str) -> Verdict:
        patch = patch_text(completion, whole=False)
        if patch is None:
            return Verdict(reward=0.0, details={"stage": "no patch"})
        forbidden = protected_paths(patch, check.test_patch)
        if forbidden:
            return Verdict(reward=0.0, details={"stage": "patch touches the tests or their configuration",
                                                "paths": forbidden[:10]})
        steps = [RunStep(name="patch", command=f"git apply --whitespace=nowarn {APPLY_EXCLUDES} "
                                               ".kiln-task/completion.diff")]
        if check.test_patch.strip():
            steps.append(RunStep(name="test-patch", command="git apply --whitespace=nowarn .kiln-task/test.diff"))
        pytest = not check.fail_to_pass and "pytest" in check.test_command
        if check.fail_to_pass:  # the image's own test command, its per-test results parsed by the exec stage
            steps.append(RunStep(name="clean", command="rm -rf .kiln-task"))
        else:
            command = f"{check.test_command} --junitxml={_JUNIT}" if pytest else check.test_command
            steps.append(RunStep(name="tests", command=f"rm -rf .kiln-task; {command}", timeout_s=check.timeout_s))
        try:
            async with self._calls:
                result = await self.exec.run_once(
                    check.image, steps=steps, fetch=[_JUNIT] if pytest else [], tests=bool(check.fail_to_pass),
                    timeout_s=check.timeout_s, files={".kiln-task/completion.diff": patch,
                                                      ".kiln-task/test.diff": check.test_patch})
        except ClientError as e:
            return self.failed(e)
        last = result.steps[-1]
        detail: dict[str, Any] = {"stage": "tests", "exit": last.exit_code, "log": (last.stdout + last.stderr)[-500:]}
        if last.name != "tests":
            return Verdict(reward=0.0, details={**detail, "stage": f"{last.name} does not apply"})
        if last.timed_out:  # the tests, with the completion's patch, ran past their time: the patch's doing
            return Verdict(reward=0.0, details=detail, policy_failure="timeout")
        if check.fail_to_pass:
            return _contract(check, result.tests, last.exit_code, detail)
        if last.exit_code != 0:
            return Verdict(reward=0.0, details=detail)
        if not pytest:
            return Verdict(reward=1.0, details=detail)
        report = next((f.text for f in result.files if f.path == _JUNIT and f.text), None)
        try:
            cases = junit(report, "pytest").cases if report else []
        except ReportError:
            cases = []
        passed = {c.name.split("[")[0].rsplit("::", 1)[-1].rsplit(".", 1)[-1] for c in cases if c.outcome == "passed"}
        missing = sorted(_added_tests(check.test_patch) - passed)
        failing = [c.name for c in cases if c.outcome in ("failed", "error")]
        if not cases or missing or failing:
            return Verdict(reward=0.0, details={**detail, "stage": "report", "missing": missing[:10],
                                                "failing": failing[:10], "report": bool(cases)})
        return Verdict(reward=1.0, details={**detail, "passed": len(passed)})


def contract_passes(report: TestReport | None, exit_code: int | None) -> set[str] | str:
    """The tests that passed in a run's per-test results, or why those results cannot be a reward (no results, or
    ``_untrusted``): the rule of the ``swe`` reward, shared with ``kiln tasks health`` so that a task's health is
    judged exactly as its completions are."""
    if report is None:
        return "no test results"
    return _untrusted(report, exit_code) or _outcomes(report)[0]


def _contract(check: SWECheck, report: TestReport | None, exit_code: int | None,
              detail: dict[str, Any]) -> Verdict:
    """1 exactly when every FAIL_TO_PASS and PASS_TO_PASS test passed in per-test results kiln trusts."""
    passed = contract_passes(report, exit_code)
    if isinstance(passed, str):
        return Verdict(reward=0.0, details={**detail, "stage": "report", "error": passed})
    fail_to_pass = [t for t in check.fail_to_pass if t not in passed]
    pass_to_pass = [t for t in check.pass_to_pass if t not in passed]
    if fail_to_pass or pass_to_pass:
        return Verdict(reward=0.0, details={**detail, "stage": "report", "fail_to_pass_not_passing": fail_to_pass[:10],
                                            "pass_to_pass_not_passing": pass_to_pass[:10]})
    return Verdict(reward=1.0, details={**detail, "passed": len(passed)})


def _untrusted(report: TestReport, exit_code: int | None) -> str:
    """Why a run's per-test results cannot be a reward ("" when they can): they disagree with the runner's own
    summary (or there are none), or the run failed while they show no failing test — as a forged report would."""
    problem = unusable_reason(report)
    if problem is not None and problem[0] == "tests_not_itemised":
        return problem[1]
    if exit_code != 0 and not any(c.outcome in ("failed", "error") for c in report.cases):
        return "the run failed but its report shows no failing test"
    return ""


def _outcomes(report: TestReport) -> tuple[set[str], set[str]]:
    """(passed, failed) test names; a name reported both ways failed (a printed pass cannot undo a failure)."""
    failed = {c.name for c in report.cases if c.outcome in ("failed", "error")}
    return {c.name for c in report.cases if c.outcome == "passed"} - failed, failed


_JUNIT = f"{REPORTS_DIR}/swe-junit.xml"
_ADDED_TEST = re.compile(r"^\+\s*(?:async\s+)?def\s+(test\w*)\s*\(", re.MULTILINE)


def _added_tests(test_patch: str) -> set[str]:
    """The test functions a test patch adds (or rewrites): what the task says done means."""
    return set(_ADDED_TEST.findall(test_patch))


class TestsCheck(BaseModel):
    """The completion's patch (``<patch>…</patch>``, a ```diff fence, or the whole text) applied to ``image`` (a
    builder-built revision), then the image's recorded test command; reward = the share of its tests that pass."""

    __test__ = False  # not a pytest class, despite the name
    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    timeout_s: float = Field(600.0, gt=0, le=3600)
    limits: SessionLimits | None = None
    expected_tests: list[str] = Field(default_factory=list, description="The image's tests (its build event's "
                                      "report): with them the reward is the share of these that pass; a name the "
                                      "run adds counts nothing and a name it lacks counts failed.")


class TestsVerifier(PerCompletion):
    """A patch that does not apply, touches the tests or their configuration (``kiln.workers.common.patches``), or
    a run without tests, scores 0. The judged code shares the runner's process or stdout, so what it could forge is
    bounded: a report whose per-test results disagree with the runner's own summary (printed passes added to a
    suite's lines) scores 0, as does one that shows no failing test from a run whose exit status (measured outside
    the sandbox) failed. With ``expected_tests`` only those names count, and one reported both passing and failing
    failed."""

    __test__ = False

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        check = checked(TestsCheck, task)
        return list(await asyncio.gather(*(self._attempt(check, c) for c in completions)))

    async def _attempt(self, check: TestsCheck, completion: str) -> Verdict:
        patch = patch_text(completion, whole=True) or ""
        forbidden = protected_paths(patch)
        if forbidden:
            return Verdict(reward=0.0, details={"stage": "patch touches the tests or their configuration",
                                                "paths": forbidden[:10]})
        apply = RunStep(name="patch", command=f"git apply --whitespace=nowarn {APPLY_EXCLUDES} .kiln-task/patch.diff")
        try:
            result = await self.exec.run_once(check.image, steps=[apply], files={".kiln-task/patch.diff": patch},
                                              tests=True, limits=check.limits, timeout_s=check.timeout_s)
        except ClientError as e:
            return self.failed(e)
        report = result.tests
        total = report.passed + report.failed + report.errors if report else 0
        last = result.steps[-1] if result.steps else None
        if report is None or not total:
            timed_out = last is not None and last.timed_out
            return Verdict(reward=0.0, details={"stage": "no tests ran"},
                           policy_failure="timeout" if timed_out else None)
        untrusted = _untrusted(report, last.exit_code if last is not None else None)
        if untrusted:
            return Verdict(reward=0.0, details={"stage": "report", "error": untrusted})
        if check.expected_tests:
            passed, failed = _outcomes(report)
            expected = set(check.expected_tests)
            passing = len(expected & passed)
            return Verdict(reward=passing / len(expected),
                           details={"passed": passing, "failed": len(expected) - passing,
                                    "unexpected": len((passed | failed) - expected)})
        # Counted per case, not per name: TAP suites repeat assertion names ("should be equal"), and printed lines
        # can only add cases to a list-shaped report, never remove the runner's failures.
        return Verdict(reward=report.passed / total,
                       details={"passed": report.passed, "failed": report.failed + report.errors})
