"""Verifiers: a reward for every sample of a prompt group, computed by kiln's own stages through their client facades.

A library (no spec): the rollout stage and the ``verify`` stage both use it, one implementation for both.

- ``exact_match``: in process, the number a completion starts with equals the task's answer.
- ``exec``: one exec ``run_once`` call checks a whole group — the groups and the task's checker files land in
  ``/work/.kiln-check`` of a warm runner, the checker runs once (see ``ExecCheck``), nothing of it outlives the call.
  Groups verified at the same time with the same checker share that call and that checker process (up to
  ``exec_batch_groups``, gathered for ``exec_batch_window_s``; at most ``exec_calls`` calls in flight): a round trip,
  and a checker's start, cost far more than checking a small group. Groups in one call could tamper with each
  other; a checker that runs sample code sets ``isolate`` and gets a call for its group alone.
- ``lean``: the statement is elaborated once (``theorem … := by sorry``), every completion is tried as a tactic script
  on that proof state, concurrently; a sample that mentions ``sorry``/``admit`` scores 0 without running.

- ``swe``: a repository task (``SWECheck``): each completion's patch and the task's test patch applied to the
  repository's built tree — one ``run_once`` call per completion; with FAIL_TO_PASS / PASS_TO_PASS (``kiln tasks
  validate``) the reward is 1 exactly when every test of both lists passes in the image's per-test results.

A user plugs in their own through the ``kiln.verifiers`` entry point group: ``name = "module:factory"``, the factory
takes a ``VerifierContext`` and returns a ``Verifier``. ``RolloutTask.check`` carries what the verifier needs; each
validates it with its own model, and a task it cannot read fails as a routine error (dead-lettered with the reason).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Annotated, Any, Literal, Protocol, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from kiln.schemas.exec import RunStep, SessionLimits
from kiln.schemas.images import REPORTS_DIR
from kiln.schemas.reports import TestReport
from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.errors import ClientError, RequestFailed, RoutineJobError, TransientJobError
from kiln.workers.common.patches import APPLY_EXCLUDES, patch_text, protected_paths
from kiln.workers.common.reports import ReportError, junit, unusable_reason
from kiln.workers.exec.client import ExecClient
from kiln.workers.lean.client import LeanClient

Failure = Literal["timeout", "sandbox_error", "invalid_task", "checker_error", "unavailable"]
"""Why a completion has no real verdict (its reward is then 0): its check ran past its time (``timeout``), the
sandbox could not run it (``sandbox_error``), the task cannot be checked as given (``invalid_task``), the checker
failed or answered nonsense (``checker_error``), or the verify request itself got no answer (``unavailable``, only
from a client)."""
FAILURES: tuple[str, ...] = get_args(Failure)


@dataclass
class Verdict:
    reward: float
    detail: dict[str, Any] = field(default_factory=dict)
    failure: Failure | None = None


class VerifyError(RoutineJobError):
    """A routine failure of a whole group's check, typed by ``failure``: the rollout stage answers it as an error,
    the verify stage as that failure on every completion of the group."""

    failure: Failure = "checker_error"


class InvalidTask(VerifyError):
    failure = "invalid_task"


class CheckTimeout(VerifyError):
    failure = "timeout"


class SandboxError(TransientJobError):
    """The stage a verifier relies on could not run the check (its request failed for good): transient for the
    rollout stage (the group is retried), ``sandbox_error`` for the verify stage."""

    failure: Failure = "sandbox_error"


class Verifier(Protocol):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]: ...

    async def close(self) -> None: ...


@dataclass
class VerifierContext:
    """What a verifier may use: the worker's client of the other stages."""

    kiln: KilnClient
    exec_calls: int = 4
    exec_batch_groups: int = 32
    exec_batch_window_s: float = 0.02
    failures_as_verdicts: bool = False  # per completion: a typed failed verdict instead of failing the whole group


_M = TypeVar("_M", bound=BaseModel)


def checked(model: type[_M], task: RolloutTask) -> _M:
    try:
        return model.model_validate(task.check)
    except ValidationError as e:
        raise InvalidTask(f"task {task.task_id}: check for {task.verifier!r} is invalid: {e}") from None


_LEADING = re.compile(r"\s*(-?\d+)")


def exact_match(task: RolloutTask, completion: str) -> float:
    """1.0 when the number the completion starts with is the answer ("7", "7 ", "7\n…" for 7; not "77", "x7")."""
    found = _LEADING.match(completion)
    return 1.0 if found is not None and found.group(1) == task.answer else 0.0


class ExactMatch:
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        return [Verdict(exact_match(task, c)) for c in completions]

    async def close(self) -> None:
        pass


class ExecCheck(BaseModel):
    """``command`` runs in a fresh directory holding ``files`` and ``groups.jsonl``: one group per line (``task_id``,
    ``prompt``, ``answer``, ``completions``). It prints one JSON line per group, in order:
    ``{"verdicts": [{"reward": r, ...}, ...]}`` (one per completion; other keys become the sample's verifier
    details) or ``{"error": "why"}`` (that group fails, the others stand)."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    command: str = Field(min_length=1)
    files: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")], str] = Field(
        default_factory=dict, description="checker files by plain name")
    timeout_s: float = Field(60.0, gt=0, le=600)
    isolate: bool = Field(False, description="a call for this group alone: for checkers that run sample code, "
                                             "which could tamper with other groups checked in the same call")


_CHECK_DIR = ".kiln-check"  # where a checker's files and groups land, beside the image's /work


class ExecVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.exec = ExecClient(context.kiln)
        self._calls = asyncio.Semaphore(context.exec_calls)
        self.batch_groups, self.batch_window_s = context.exec_batch_groups, context.exec_batch_window_s
        self._batches: dict[tuple[str, str, float, str], list[_Pending]] = {}
        self._running: set[asyncio.Future[None]] = set()

    async def close(self) -> None:
        pass

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(ExecCheck, task)
        group = {"task_id": task.task_id, "prompt": task.prompt, "answer": task.answer, "completions": completions}
        pending = _Pending(group, asyncio.get_running_loop().create_future())
        if check.isolate:
            async with self._calls:
                await self._run([pending], check)
            return await pending.done
        key = (check.image, check.command, check.timeout_s, json.dumps(check.files, sort_keys=True))
        batch = self._batches.setdefault(key, [])
        batch.append(pending)
        if len(batch) == 1:
            self._spawn(self._dispatch(key, check))
        return await pending.done

    def _spawn(self, dispatch: Coroutine[Any, Any, None]) -> None:
        running = asyncio.ensure_future(dispatch)
        self._running.add(running)
        running.add_done_callback(self._running.discard)

    async def _dispatch(self, key: tuple[str, str, float, str], check: ExecCheck) -> None:
        """Sends the groups gathered for ``key`` once a call may start: while every call is busy, groups keep
        joining the waiting batch (so batches grow with load instead of queueing as many small commands)."""
        await asyncio.sleep(self.batch_window_s)
        async with self._calls:
            waiting = self._batches.pop(key, [])
            batch, rest = waiting[:self.batch_groups], waiting[self.batch_groups:]
            for p in rest:  # beyond one command's share: they start the next batch
                self._batches.setdefault(key, []).append(p)
            if rest:
                self._spawn(self._dispatch(key, check))
            await self._run(batch, check)

    async def _run(self, batch: list[_Pending], check: ExecCheck) -> None:
        """One ``run_once`` call, one checker process for the whole batch, in a sandbox nothing of it outlives."""
        files = {f"{_CHECK_DIR}/{name}": text for name, text in
                 {**check.files, "groups.jsonl": "".join(json.dumps(p.group) + "\n" for p in batch)}.items()}
        try:
            try:
                result = await self.exec.run_once(check.image, check.command, files=files, cwd=_CHECK_DIR,
                                                  timeout_s=check.timeout_s, max_output_bytes=4 << 20)
            except RequestFailed as e:
                raise SandboxError(f"exec run_once failed: {e.reason}") from None
            output = result.output
            assert output is not None
            if output.timed_out:
                raise CheckTimeout(f"checker ran past {check.timeout_s} s on {len(batch)} groups")
            if output.exit_code != 0:
                raise VerifyError(f"checker exited {output.exit_code} (timed out: {output.timed_out}) on "
                                      f"{len(batch)} groups: {output.stderr[-2000:]}")
            if output.stdout_truncated:
                raise VerifyError(f"checker output over 4 MB for {len(batch)} groups")
            lines = [line for line in output.stdout.splitlines() if line.strip()]
            if len(lines) != len(batch):
                raise VerifyError(f"checker printed {len(lines)} lines for {len(batch)} groups")
        except Exception as e:
            for p in batch:
                p.done.set_exception(e)
            return
        for p, line in zip(batch, lines, strict=True):
            try:
                p.done.set_result(parse_verdicts(line, len(p.group["completions"]), p.group["task_id"]))
            except VerifyError as e:
                p.done.set_exception(e)


@dataclass
class _Pending:
    group: dict[str, Any]
    done: asyncio.Future[list[Verdict]]


def parse_verdicts(line: str, expected: int, task_id: str) -> list[Verdict]:
    """A group's line: ``{"verdicts": [{"reward": r, ...}, ...]}`` or ``{"error": "why"}``; anything else is the
    checker's fault (routine error). A verdict may carry ``"failure"`` (one of ``FAILURES``, e.g. ``"timeout"`` for
    a completion the checker stopped): its reward is then 0."""
    try:
        item = json.loads(line)
        if "error" in item:
            raise InvalidTask(f"task {task_id}: the checker refused the group: {str(item['error'])[:1000]}")
        verdicts = [_verdict(v) for v in item["verdicts"]]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise VerifyError(f"task {task_id}: checker printed {line[:200]!r}: {type(e).__name__}: {e}") from None
    if len(verdicts) != expected:
        raise VerifyError(f"task {task_id}: checker gave {len(verdicts)} verdicts for {expected} completions")
    return verdicts


def _verdict(item: dict[str, Any]) -> Verdict:
    failure = item.get("failure")
    if failure is not None and failure not in FAILURES:
        raise ValueError(f"failure {failure!r} is not one of {FAILURES}")
    detail = {k: x for k, x in item.items() if k not in ("reward", "failure")}
    return Verdict(0.0 if failure else float(item["reward"]), detail, failure)


class LeanCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    statement: str = Field(min_length=1, description="the proposition, as after `theorem name :`")
    header: list[str] = Field(default_factory=list)
    timeout_s: float = Field(30.0, gt=0, le=600)


_UNSOUND = re.compile(r"\b(sorry|admit)\b")


class LeanVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.lean = LeanClient(context.kiln)
        self.failures_as_verdicts = context.failures_as_verdicts

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(LeanCheck, task)
        root = await self.lean.run_code(f"theorem kiln_goal : {check.statement} := by sorry", header=check.header,
                                        timeout_s=check.timeout_s, key=request_id)
        if not root.ok or len(root.sorries) != 1:
            raise InvalidTask(f"task {task.task_id}: the statement does not elaborate to one goal: "
                                  f"{root.error or root.messages}")
        state = root.sorries[0].state

        async def attempt(proof: str) -> Verdict:
            if not proof.strip() or _UNSOUND.search(proof):
                return Verdict(0.0, {"error": "empty or unsound proof"})
            try:
                result = await self.lean.run_tactic(state, proof, timeout_s=check.timeout_s)
            except RequestFailed as e:
                if not self.failures_as_verdicts:
                    raise
                timed_out = "ReplTimeout" in e.reason
                return Verdict(0.0, {"error": e.reason[:500]}, "timeout" if timed_out else "sandbox_error")
            return Verdict(1.0 if result.completed else 0.0,
                           {"error": result.error, "goals_left": len(result.goals)} if not result.completed else {})

        return list(await asyncio.gather(*(attempt(c) for c in completions)))

    async def close(self) -> None:
        pass


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


class SWEVerifier:
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
        self.exec = ExecClient(context.kiln)
        self._calls = asyncio.Semaphore(context.exec_calls)
        self.failures_as_verdicts = context.failures_as_verdicts

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        check = checked(SWECheck, task)
        return list(await asyncio.gather(*(self._attempt(check, c) for c in completions)))

    async def _attempt(self, check: SWECheck, completion: str) -> Verdict:
        patch = patch_text(completion, whole=False)
        if patch is None:
            return Verdict(0.0, {"stage": "no patch"})
        forbidden = protected_paths(patch, check.test_patch)
        if forbidden:
            return Verdict(0.0, {"stage": "patch touches the tests or their configuration", "paths": forbidden[:10]})
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
        except RequestFailed as e:
            if self.failures_as_verdicts:
                return Verdict(0.0, {"error": e.reason[:500]}, "sandbox_error")
            raise SandboxError(f"exec run_once failed: {e.reason}") from None
        last = result.steps[-1]
        detail: dict[str, Any] = {"stage": "tests", "exit": last.exit_code, "log": (last.stdout + last.stderr)[-500:]}
        if last.name != "tests":
            return Verdict(0.0, {**detail, "stage": f"{last.name} does not apply"})
        if last.timed_out:
            return Verdict(0.0, detail, "timeout")
        if check.fail_to_pass:
            return _contract(check, result.tests, last.exit_code, detail)
        if last.exit_code != 0:
            return Verdict(0.0, detail)
        if not pytest:
            return Verdict(1.0, detail)
        report = next((f.text for f in result.files if f.path == _JUNIT and f.text), None)
        try:
            cases = junit(report, "pytest").cases if report else []
        except ReportError:
            cases = []
        passed = {c.name.split("[")[0].rsplit("::", 1)[-1].rsplit(".", 1)[-1] for c in cases if c.outcome == "passed"}
        missing = sorted(_added_tests(check.test_patch) - passed)
        failing = [c.name for c in cases if c.outcome in ("failed", "error")]
        if not cases or missing or failing:
            return Verdict(0.0, {**detail, "stage": "report", "missing": missing[:10], "failing": failing[:10],
                                 "report": bool(cases)})
        return Verdict(1.0, {**detail, "passed": len(passed)})

    async def close(self) -> None:
        pass


def _contract(check: SWECheck, report: TestReport | None, exit_code: int | None,
              detail: dict[str, Any]) -> Verdict:
    """1 exactly when every FAIL_TO_PASS and PASS_TO_PASS test passed in per-test results kiln trusts."""
    if report is None:
        return Verdict(0.0, {**detail, "stage": "report", "error": "no test results"})
    untrusted = _untrusted(report, exit_code)
    if untrusted:
        return Verdict(0.0, {**detail, "stage": "report", "error": untrusted})
    passed, _failed = _outcomes(report)
    fail_to_pass = [t for t in check.fail_to_pass if t not in passed]
    pass_to_pass = [t for t in check.pass_to_pass if t not in passed]
    if fail_to_pass or pass_to_pass:
        return Verdict(0.0, {**detail, "stage": "report", "fail_to_pass_not_passing": fail_to_pass[:10],
                             "pass_to_pass_not_passing": pass_to_pass[:10]})
    return Verdict(1.0, {**detail, "passed": len(passed)})


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


class ProgramCheck(BaseModel):
    """A completion's program — its fenced code block (```python …```), or its whole text — run on ``stdin`` in
    ``language``'s interpreter; reward 1 when it exits 0 and prints ``expected_output`` (trailing whitespace of each
    line ignored): the stdin/stdout check of code-RL datasets (verl's, SandboxFusion's)."""

    model_config = ConfigDict(extra="forbid")

    expected_output: str
    stdin: str = ""
    language: Literal["python", "bash", "nodejs"] = "python"
    image: str = Field("kiln/toolchain:latest", min_length=1)
    timeout_s: float = Field(10.0, gt=0, le=600)
    limits: SessionLimits | None = None


PROGRAM_RUNNERS = {"python": ("main.py", "python3 main.py"), "bash": ("main.sh", "bash main.sh"),
                   "nodejs": ("main.js", "node main.js")}
_CODE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


class _PerCompletion:
    """A ``run_once`` call (or Lean job) per completion, all in flight at once: sample code runs alone."""

    def __init__(self, context: VerifierContext) -> None:
        self.exec = ExecClient(context.kiln)
        self.lean = LeanClient(context.kiln)
        self.failures_as_verdicts = context.failures_as_verdicts

    async def close(self) -> None:
        pass

    def failed(self, e: ClientError) -> Verdict:
        """A job that failed for good (or expired, or whose result was lost): the completion's typed verdict, or
        for the rollout stage a ``SandboxError`` (its group is retried)."""
        reason = e.reason if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
        if not self.failures_as_verdicts:
            raise SandboxError(reason) from None
        return Verdict(0.0, {"error": reason[:500]}, "timeout" if "Timeout" in reason else "sandbox_error")


class ProgramVerifier(_PerCompletion):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        check = checked(ProgramCheck, task)
        return list(await asyncio.gather(*(self._attempt(check, c) for c in completions)))

    async def _attempt(self, check: ProgramCheck, completion: str) -> Verdict:
        found = _CODE.search(completion)
        source, command = PROGRAM_RUNNERS[check.language]
        try:
            result = await self.exec.run_once(check.image, command, files={source: found.group(1) if found else
                                                                           completion},
                                              stdin=check.stdin, timeout_s=check.timeout_s, limits=check.limits)
        except ClientError as e:
            return self.failed(e)
        output = result.output
        if output is None:
            return Verdict(0.0, {"error": "no output"}, "sandbox_error")
        if output.timed_out:
            return Verdict(0.0, {"exit": output.exit_code}, "timeout")
        if output.exit_code != 0:
            return Verdict(0.0, {"exit": output.exit_code})
        return Verdict(1.0 if _lines(output.stdout) == _lines(check.expected_output) else 0.0, {"exit": 0})


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


class TestsVerifier(_PerCompletion):
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
            return Verdict(0.0, {"stage": "patch touches the tests or their configuration", "paths": forbidden[:10]})
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
            return Verdict(0.0, {"stage": "no tests ran"}, "timeout" if timed_out else None)
        untrusted = _untrusted(report, last.exit_code if last is not None else None)
        if untrusted:
            return Verdict(0.0, {"stage": "report", "error": untrusted})
        if check.expected_tests:
            passed, failed = _outcomes(report)
            expected = set(check.expected_tests)
            passing = len(expected & passed)
            return Verdict(passing / len(expected), {"passed": passing, "failed": len(expected) - passing,
                                                     "unexpected": len((passed | failed) - expected)})
        # Counted per case, not per name: TAP suites repeat assertion names ("should be equal"), and printed lines
        # can only add cases to a list-shaped report, never remove the runner's failures.
        return Verdict(report.passed / total, {"passed": report.passed, "failed": report.failed + report.errors})


class LeanCodeCheck(BaseModel):
    """The completion after ``statement`` (e.g. ``theorem t : p → p := by``) as one Lean ``run_code``; reward 1 when
    Lean accepts it without ``sorry``."""

    model_config = ConfigDict(extra="forbid")

    statement: str = ""
    timeout_s: float = Field(60.0, gt=0, le=600)


class LeanCodeVerifier(_PerCompletion):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        check = checked(LeanCodeCheck, task)
        return list(await asyncio.gather(*(self._attempt(check, c) for c in completions)))

    async def _attempt(self, check: LeanCodeCheck, completion: str) -> Verdict:
        try:
            result = await self.lean.run_code(f"{check.statement} {completion}".strip(), timeout_s=check.timeout_s)
        except ClientError as e:
            return self.failed(e)
        if result.ok and not result.sorries:
            return Verdict(1.0)
        return Verdict(0.0, {"error": (result.error or "")[:500], "sorries": len(result.sorries)})


BUILT_IN: dict[str, Callable[[VerifierContext], Verifier]] = {
    "exact_match": lambda _ctx: ExactMatch(), "exec": ExecVerifier, "lean": LeanVerifier, "swe": SWEVerifier,
    "program": ProgramVerifier, "tests": TestsVerifier, "lean_code": LeanCodeVerifier}


class Verifiers:
    """The verifiers a rollout worker knows, made on first use."""

    def __init__(self, context: VerifierContext) -> None:
        self.context = context
        self.factories = dict(BUILT_IN)
        for point in entry_points(group="kiln.verifiers"):
            self.factories[point.name] = point.load()
        self._made: dict[str, Verifier] = {}

    def get(self, name: str) -> Verifier:
        if name not in self._made:
            if name not in self.factories:
                raise InvalidTask(f"no verifier {name!r} (known: {sorted(self.factories)})")
            self._made[name] = self.factories[name](self.context)
        return self._made[name]

    async def close(self) -> None:
        for verifier in self._made.values():
            await verifier.close()
        await self.context.kiln.close()

