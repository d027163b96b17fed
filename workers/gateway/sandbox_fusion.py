"""SandboxFusion's ``/run_code`` over kiln's exec stage: each request runs in a fresh exec session on the toolchain
image (the warm pool makes opening one cheap), closed after the answer. Request and response fields are
SandboxFusion's; ``memory_limit_MB`` becomes the session's memory limit."""

from __future__ import annotations

import asyncio
import base64
import logging
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.schemas.exec import SessionLimits
from kiln.streams.errors import KilnError
from kiln.workers.exec.client import ExecClient
from kiln.workers.gateway.languages import LANGUAGES, Language, driver, write_file
from kiln.workers.gateway.settings import GatewaySettings

log = logging.getLogger("kiln.gateway")
router = APIRouter(tags=["SandboxFusion"])
_INLINE = 90_000  # characters of command that carry the files inline; beyond, files are written first
_closing: set[asyncio.Task[None]] = set()


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
    # A language without a compile step never uses compile_timeout: SandboxFusion's default (10) or any other value
    # is accepted for it.
    for name in ("compile_timeout", "run_timeout") if LANGUAGES[request.language].compile else ("run_timeout",):
        value = getattr(request, name)
        if not 0 < value <= settings.max_timeout_s:
            raise HTTPException(400, f"{name}={value:g}s is outside kiln's limit (0, {settings.max_timeout_s:g}] "
                                     "(KILN_GATEWAY_MAX_TIMEOUT_S)")
    if request.memory_limit_MB > settings.max_memory_mb:
        raise HTTPException(400, f"memory_limit_MB={request.memory_limit_MB} is over kiln's limit "
                                 f"{settings.max_memory_mb} (KILN_GATEWAY_MAX_MEMORY_MB)")


def driver_command(request: RunCodeRequest, settings: GatewaySettings, *, inline: bool = True) -> str:
    """The one command that runs ``request`` in a session; ``inline=False`` leaves the files to write_files."""
    files = request_files(request) if inline else {}
    return driver(LANGUAGES[request.language], writes="".join(write_file(p, c) for p, c in files.items()),
                  stdin=request.stdin, compile_timeout=request.compile_timeout, run_timeout=request.run_timeout,
                  fetch_files=[_relative(p) for p in request.fetch_files], cap=settings.max_output_bytes)


def request_files(request: RunCodeRequest) -> dict[str, str]:
    """Every file of the run directory, base64: the request's and the source."""
    files = {_relative(p): c or "" for p, c in request.files.items()}
    files[LANGUAGES[request.language].source] = base64.b64encode(request.code.encode()).decode()
    return files


def _step(fields: list[str], limit: float) -> CommandRunResult:
    code, elapsed = int(fields[0]), int(fields[1]) / 1e6
    timed_out = code == 137 and elapsed >= limit * 0.95  # timeout -s KILL
    return CommandRunResult(status="TimeLimitExceeded" if timed_out else "Finished", execution_time=round(elapsed, 4),
                            return_code=None if timed_out else code,
                            stdout=base64.b64decode(fields[2]).decode(errors="replace"),
                            stderr=base64.b64decode(fields[3]).decode(errors="replace"))


def read_driver_output(request: RunCodeRequest, stdout: str) -> RunCodeResponse:
    steps: dict[str, CommandRunResult] = {}
    files: dict[str, str] = {}
    for line in stdout.splitlines():
        fields = line.split(" ")
        if fields[0] == "STEP" and len(fields) == 6 and fields[1] in ("compile", "run"):
            limit = request.compile_timeout if fields[1] == "compile" else request.run_timeout
            steps[fields[1]] = _step(fields[2:], limit)
        elif fields[0] == "FILE" and len(fields) == 3:
            files[base64.b64decode(fields[1]).decode(errors="replace")] = fields[2]
    compiled, ran = steps.get("compile"), steps.get("run")
    ok = ran is not None and ran.return_code == 0 and (compiled is None or compiled.return_code == 0)
    return RunCodeResponse(status=RunStatus.success if ok else RunStatus.failed, compile_result=compiled,
                           run_result=ran, files=files)


async def run_code(exec_client: ExecClient, settings: GatewaySettings, request: RunCodeRequest) -> RunCodeResponse:
    refuse_beyond_limits(request, settings)
    language: Language = LANGUAGES[request.language]
    command = driver_command(request, settings)
    # The exec stage's default limits unless the request sets memory: only those are served from the warm pool.
    limits = SessionLimits()
    if request.memory_limit_MB > 0:
        limits = SessionLimits(memory_mb=max(request.memory_limit_MB, 32))
    try:
        session = await exec_client.open_session(settings.toolchain_image, limits=limits)
    except KilnError as e:
        return RunCodeResponse(status=RunStatus.sandbox_error, message=f"opening a session: {e}")
    try:
        if len(command) > _INLINE:
            await exec_client.write_files(session, {f"run/{p}": base64.b64decode(c)
                                                    for p, c in request_files(request).items()})
            command = driver_command(request, settings, inline=False)
        budget = (request.compile_timeout if language.compile else 0) + request.run_timeout + 30
        output = await exec_client.run(session, command, timeout_s=budget, max_output_bytes=settings.exec_output_bytes)
    except KilnError as e:
        return RunCodeResponse(status=RunStatus.sandbox_error, message=str(e))
    finally:
        closing = asyncio.get_running_loop().create_task(_close(exec_client, session))
        _closing.add(closing)  # a task nothing references may be collected before it ran
        closing.add_done_callback(_closing.discard)
    answer = read_driver_output(request, output.stdout)
    if answer.run_result is None and answer.compile_result is None:
        return RunCodeResponse(status=RunStatus.sandbox_error, message=f"the driver answered no result (exit "
                                                                       f"{output.exit_code}): {output.stderr[-500:]}")
    return answer


async def _close(exec_client: ExecClient, session: Any) -> None:
    try:
        await exec_client.close_session(session)
    except KilnError as e:  # the worker reaps idle sessions anyway
        log.warning("closing session %s: %s", session.session_id, e)


@router.post("/run_code", response_model=RunCodeResponse)
async def run_code_route(body: RunCodeRequest, request: Request) -> RunCodeResponse:
    state = request.app.state
    return await run_code(state.exec_client, state.settings, body)
