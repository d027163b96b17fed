"""SandboxFusion's online judge, ``POST /submit``, for problems a trainer brings along: ``config.dataset_type`` is
``CommonOJDataset`` and ``config.provided_data`` the problem (its ``test``: stdin/stdout cases). kiln hosts no
datasets, so a submit naming one without its data is refused.

The completion's program is found as SandboxFusion finds it (``extraction.py``), compiled once and run on every case
in one exec ``run_once`` call per 15 cases (a call's step limit: a compile step and the cases, each its own step,
measured by the runner's supervisor; a case that fails does not stop the next). The calls are all in flight at once.
A case passes when its run exits 0 and its output matches the expected one as SandboxFusion compares them: line by
line, trimmed, case-insensitive, numbers within a relative 1e-5. The expected outputs never enter the sandbox. Without
``config.extra.run_all_cases`` the answer stops at the first failing case, as SandboxFusion's does.

What the program prints is bounded for the whole submit (``KILN_GATEWAY_MAX_SUBMIT_OUTPUT_BYTES``): each case's
stdout and stderr get an equal share, never less than its expected output and 4 KiB more, never more than
``KILN_GATEWAY_MAX_OUTPUT_BYTES``. A case whose stdout was cut there fails (SandboxFusion, which cuts nothing, would
have compared the rest: "the answer, then a flood" must not pass on its first part).

Refused with HTTP 400, saying why: a dataset type or data kiln does not serve, no language, a language kiln does
not serve, timeouts over kiln's caps (the run_code ones: ``KILN_GATEWAY_MAX_TIMEOUT_S``, ``KILN_GATEWAY_MAX_COMPILE_S``
per language), more cases than ``KILN_GATEWAY_MAX_SUBMIT_CASES``, a problem without cases (it would accept any
program), and ``custom_extract_logic`` (Python SandboxFusion ``exec``s in its server process: kiln runs no
submitted code outside a sandbox). A sandbox call that fails answers HTTP 500 with the reason (the client retries);
it never becomes a failed case.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.integrations.gateway.extraction import extract
from kiln.integrations.gateway.languages import LANGUAGES
from kiln.integrations.gateway.sandbox_fusion import (
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    command_result,
    compile_steps,
    refuse_beyond_limits,
    run_response,
)
from kiln.integrations.gateway.settings import GatewaySettings
from kiln.schemas.exec import RunStep
from kiln.streams.errors import KilnError
from kiln.workers.exec.client import ExecClient

router = APIRouter(tags=["SandboxFusion"])
DATASET_TYPE = "CommonOJDataset"
CALL_STEPS = 16  # steps one run_once call takes (ExecRequest.steps)
OUTPUT_MARGIN = 4096  # bytes a case may print beyond its expected output, whatever its share of the submit's budget
SHOWN_CHARS = 1000  # a passed case's input and output strings are shortened to this in the answer, as SandboxFusion's


class TestConfig(BaseModel):
    """SandboxFusion's ``TestConfig``; fields kiln has no use for (locale, is_fewshot) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    __test__ = False  # (pytest: not a test class)

    dataset_type: str | None = None
    language: str | None = None
    compile_timeout: float | None = None
    run_timeout: float | None = None
    custom_extract_logic: str | None = None
    provided_data: list[dict[str, Any]] | dict[str, Any] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    dataset: str
    id: int | str
    completion: str
    config: TestConfig


class StdioCase(BaseModel):
    """A test case: ``input["stdin"]`` fed to the program, ``output["stdout"]`` expected from it."""

    input: dict[str, str]
    output: dict[str, str]


class EvalTestCase(BaseModel):
    passed: bool
    exec_info: RunCodeResponse
    test_info: dict[str, Any] | None = None


class EvalResult(BaseModel):
    id: int | str
    accepted: bool
    extracted_code: str
    full_code: str | None = None
    test_code: str | None = None
    tests: list[EvalTestCase]
    extracted_type: str | None = None
    extra: dict[str, Any] | None = None


def problem_cases(config: TestConfig, settings: GatewaySettings) -> list[StdioCase]:
    """The problem's test cases from ``provided_data``, or a refusal saying what is missing."""
    if config.dataset_type != DATASET_TYPE:
        raise HTTPException(400, f"dataset_type {config.dataset_type!r}: kiln serves /submit for {DATASET_TYPE} "
                                 "with the problem in config.provided_data only (it hosts no datasets)")
    data = config.provided_data
    if not isinstance(data, dict):
        raise HTTPException(400, "config.provided_data must be the problem: an object with its `test` cases")
    tests = data.get("test")
    try:
        if isinstance(tests, str):
            tests = json.loads(tests)
        if not isinstance(tests, list):
            raise ValueError("not a list")
        cases = [StdioCase.model_validate(t) for t in tests]
    except (ValueError, ValidationError) as e:
        raise HTTPException(400, f"config.provided_data.test must be a list of {{input: {{stdin}}, output: "
                                 f"{{stdout}}}} cases: {str(e)[:500]}") from None
    if not cases:
        raise HTTPException(400, "config.provided_data.test has no cases: a problem without tests would accept any "
                                 "program")
    if len(cases) > settings.max_submit_cases:
        raise HTTPException(400, f"{len(cases)} test cases is over kiln's limit {settings.max_submit_cases} "
                                 "(KILN_GATEWAY_MAX_SUBMIT_CASES)")
    for i, case in enumerate(cases):
        if "stdin" not in case.input or "stdout" not in case.output:
            raise HTTPException(400, f"test case {i} needs input.stdin and output.stdout")
    return cases


def same_output(stdout: str, expected: str) -> bool:
    """SandboxFusion's comparison: the same number of lines, each equal once trimmed and lower-cased, or both
    numbers within a relative 1e-5 of the expected one."""
    got, want = stdout.strip().split("\n"), expected.strip().split("\n")
    return len(got) == len(want) and all(_same_line(g.lower().strip(), w.lower().strip())
                                         for g, w in zip(got, want, strict=True))


def _same_line(got: str, want: str) -> bool:
    if got == want:
        return True
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    return abs(a - b) / max(abs(b), 1e-10) < 1e-5


def _shortened(text: str) -> str:
    if len(text) <= SHOWN_CHARS:
        return text
    keep = (SHOWN_CHARS - 3) // 2
    return f"{text[:keep]}...{text[-keep:]}"


def _outcome(case: StdioCase, info: RunCodeResponse, cut: bool, full: bool) -> EvalTestCase:
    ran = info.run_result
    passed = (info.status == RunStatus.success and ran is not None and not cut
              and same_output(ran.stdout or "", case.output["stdout"]))
    shown = case.model_dump()
    if passed and not full:
        shown = {part: {k: _shortened(v) for k, v in values.items()} for part, values in shown.items()}
    return EvalTestCase(passed=passed, exec_info=info, test_info=shown)


def output_cap(settings: GatewaySettings, chunk: list[StdioCase], cases: int) -> int:
    """Bytes each stream of each case of ``chunk`` may print: its share of the submit's budget (``cases`` in all), at
    least the chunk's longest expected output and a margin, at most the run_code cap."""
    share = settings.max_submit_output_bytes // (2 * cases)
    expected = max(len(case.output["stdout"].encode()) for case in chunk)
    return min(settings.max_output_bytes, max(share, expected + OUTPUT_MARGIN))


async def _run_chunk(exec_client: ExecClient, settings: GatewaySettings, run: RunCodeRequest,
                     chunk: list[StdioCase], first: int, total: int) -> list[tuple[RunCodeResponse, bool]]:
    """One ``run_once`` call: the program compiled once, then run on every case of ``chunk`` (of ``total``); each
    case's answer, and whether its stdout was cut at its cap (its stderr is never compared)."""
    language = LANGUAGES[run.language]
    compiling = compile_steps(run)
    try:
        cases = [RunStep(name=f"case{first + i}", command=language.run, timeout_s=run.run_timeout,
                         stdin=case.input["stdin"], always=True) for i, case in enumerate(chunk)]
    except ValidationError as e:
        raise HTTPException(400, f"a test case kiln cannot run: {str(e)[:500]}") from None
    try:
        result = await exec_client.run_once(settings.toolchain_image, files={f"run/{language.source}": run.code},
                                            steps=[*compiling, *cases], cwd="run",
                                            max_output_bytes=output_cap(settings, chunk, total))
    except KilnError as e:
        raise HTTPException(500, f"the sandbox could not run the cases: {e}") from None
    outputs = {s.name: s for s in result.steps}
    steps = {name: command_result(s) for name, s in outputs.items()}
    compiled = steps.get("compile") if compiling else None
    if compiled is not None and compiled.return_code != 0:  # nothing ran: each case reports the failed compile
        return [(run_response(compiled, None), False) for _ in chunk]
    return [(run_response(compiled, steps.get(step.name)), step.name in outputs and outputs[step.name].stdout_truncated)
            for step in cases]


async def judge(exec_client: ExecClient, settings: GatewaySettings, body: SubmitRequest) -> EvalResult:
    config = body.config
    cases = problem_cases(config, settings)
    if not config.language:
        raise HTTPException(400, f"config.language field must exist for {DATASET_TYPE}, got None")
    if config.custom_extract_logic is not None:
        raise HTTPException(400, "custom_extract_logic is Python the server would run outside any sandbox: kiln "
                                 "does not; send the completion as it is (the code is found as SandboxFusion "
                                 "finds it)")
    compiled = config.language in LANGUAGES and LANGUAGES[config.language].compile is not None
    code = extract(body.completion, config.language)
    run = RunCodeRequest(code=code, language=config.language, compile_timeout=config.compile_timeout or 10,
                         run_timeout=config.run_timeout or (10 if compiled else 20))
    refuse_beyond_limits(run, settings)
    per_call = CALL_STEPS - len(compile_steps(run))
    chunks = [cases[i:i + per_call] for i in range(0, len(cases), per_call)]
    answers = await asyncio.gather(*(_run_chunk(exec_client, settings, run, chunk, i * per_call, len(cases))
                                     for i, chunk in enumerate(chunks)))
    full = bool(config.extra.get("return_full_case", False))
    outcomes: list[EvalTestCase] = []
    for case, (info, cut) in zip(cases, [ran for answer in answers for ran in answer], strict=True):
        outcomes.append(_outcome(case, info, cut, full))
        if not outcomes[-1].passed and not config.extra.get("run_all_cases", False):
            break
    return EvalResult(id=body.id, accepted=all(o.passed for o in outcomes), extracted_code=code, tests=outcomes)


@router.post("/submit", response_model=EvalResult)
async def submit(body: SubmitRequest, request: Request) -> EvalResult:
    state = request.app.state
    return await judge(state.exec_client, state.settings, body)
