"""SandboxFusion's ``/run_code`` over kiln's exec stage: each request is one ``run_once`` call on the toolchain
image (a warm runner; its compile and run steps measured by the runner's supervisor). Request and response fields
are SandboxFusion's; ``memory_limit_MB`` becomes the call's memory limit."""

from __future__ import annotations

import base64
import logging
from enum import StrEnum
from pathlib import PurePosixPath

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.integrations.gateway.languages import LANGUAGES, Language
from kiln.integrations.gateway.settings import GatewaySettings
from kiln.schemas.exec import RunStep, SessionLimits, StepOutput
from kiln.streams.errors import KilnError
from kiln.workers.exec.client import ExecClient

log = logging.getLogger("kiln.gateway")
router = APIRouter(tags=["SandboxFusion"])


class RunStatus(StrEnum):
    success = "Success"
    failed = "Failed"
    sandbox_error = "SandboxError"


class CommandRunResult(BaseModel):
    status: str = Field(description="Finished | TimeLimitExceeded | Error")
    execution_time: float | None = None
    cpu_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    """SandboxFusion's request; fields kiln has no use for are accepted and ignored (README)."""

    model_config = ConfigDict(extra="ignore")

    code: str
    language: str
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list)

    @field_validator("files")
    @classmethod
    def _base64(cls, files: dict[str, str | None]) -> dict[str, str | None]:
        """Refused here (HTTP 422), not half-written into the sandbox: every content must be valid base64."""
        for path, content in files.items():
            try:
                base64.b64decode(content or "", validate=True)
            except ValueError:
                raise ValueError(f"files[{path!r}] is not base64") from None
        return files


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def _relative(path: str) -> str:
    clean = PurePosixPath(path)
    if clean.is_absolute() or ".." in clean.parts or not clean.parts:
        raise HTTPException(400, f"file path {path!r}: only paths inside the run directory are allowed")
    return str(clean)


def refuse_beyond_limits(request: RunCodeRequest, settings: GatewaySettings) -> None:
    """kiln's caps, said plainly: a request over them is refused, never silently shortened."""
    if request.language not in LANGUAGES:
        raise HTTPException(400, f"language {request.language!r} is not served by kiln "
                                 f"(served: {', '.join(sorted(LANGUAGES))})")
    if not 0 < request.run_timeout <= settings.max_timeout_s:
        raise HTTPException(400, f"run_timeout={request.run_timeout:g}s is outside kiln's limit "
                                 f"(0, {settings.max_timeout_s:g}] (KILN_GATEWAY_MAX_TIMEOUT_S)")
    # A language without a compile step never uses compile_timeout: SandboxFusion's default (10) or any other value
    # is accepted for it. A compiled language has a cap of its own (languages.py says why each).
    if LANGUAGES[request.language].compile is not None:
        cap = settings.max_compile_s[request.language]
        if not 0 < request.compile_timeout <= cap:
            raise HTTPException(400, f"compile_timeout={request.compile_timeout:g}s is outside kiln's limit for "
                                     f"{request.language} (0, {cap:g}] (KILN_GATEWAY_MAX_COMPILE_S)")
    if request.memory_limit_MB > settings.max_memory_mb:
        raise HTTPException(400, f"memory_limit_MB={request.memory_limit_MB} is over kiln's limit "
                                 f"{settings.max_memory_mb} (KILN_GATEWAY_MAX_MEMORY_MB)")


def request_files(request: RunCodeRequest) -> dict[str, bytes]:
    """Every file of the run directory: the request's and the source."""
    files = {_relative(p): base64.b64decode(c or "") for p, c in request.files.items()}
    files[LANGUAGES[request.language].source] = request.code.encode()
    return files


def compile_steps(request: RunCodeRequest) -> list[RunStep]:
    """The compile step with the compile timeout, for a compiled language; none for the others."""
    language: Language = LANGUAGES[request.language]
    if language.compile is None:
        return []
    return [RunStep(name="compile", command=language.compile, timeout_s=request.compile_timeout)]


def run_steps(request: RunCodeRequest) -> list[RunStep]:
    """Compile (for a compiled language) with the compile timeout, then run with stdin and the run timeout."""
    language: Language = LANGUAGES[request.language]
    return [*compile_steps(request),
            RunStep(name="run", command=language.run, timeout_s=request.run_timeout, stdin=request.stdin)]


def command_result(step: StepOutput) -> CommandRunResult:
    return CommandRunResult(status="TimeLimitExceeded" if step.timed_out else "Finished",
                            execution_time=step.duration_s, cpu_time=step.cpu_s,
                            return_code=None if step.timed_out else step.exit_code, stdout=step.stdout,
                            stderr=step.stderr)


async def run_code(exec_client: ExecClient, settings: GatewaySettings, request: RunCodeRequest) -> RunCodeResponse:
    """One ``run_once`` call: each step's exit status, time and output are measured by the runner's supervisor,
    outside the reach of the code it judges (README, "Threat model")."""
    refuse_beyond_limits(request, settings)
    limits = SessionLimits(memory_mb=max(request.memory_limit_MB, 32)) if request.memory_limit_MB > 0 else None
    try:
        result = await exec_client.run_once(settings.toolchain_image, files={f"run/{p}": c for p, c in
                                                                           request_files(request).items()},
                                            steps=run_steps(request), limits=limits, cwd="run",
                                            max_output_bytes=settings.max_output_bytes,
                                            fetch=[_relative(p) for p in request.fetch_files])
    except KilnError as e:
        return RunCodeResponse(status=RunStatus.sandbox_error, message=str(e))
    steps = {s.name: command_result(s) for s in result.steps}
    files = {f.path: f.content_b64 or base64.b64encode((f.text or "").encode()).decode() for f in result.files}
    return run_response(steps.get("compile"), steps.get("run"), files)


def run_response(compiled: CommandRunResult | None, ran: CommandRunResult | None,
                 files: dict[str, str] | None = None) -> RunCodeResponse:
    """SandboxFusion's answer for a compile (None: no compile step) and a run (None: it did not run): Success when
    each that happened exited 0."""
    ok = ran is not None and ran.return_code == 0 and (compiled is None or compiled.return_code == 0)
    return RunCodeResponse(status=RunStatus.success if ok else RunStatus.failed, compile_result=compiled,
                           run_result=ran, files=files or {})


@router.post("/run_code", response_model=RunCodeResponse)
async def run_code_route(body: RunCodeRequest, request: Request) -> RunCodeResponse:
    state = request.app.state
    return await run_code(state.exec_client, state.settings, body)
