"""SandboxFusion's ``/run_code`` over kiln's exec stage: each request runs in a fresh exec session on the toolchain
image (the warm pool makes opening one cheap), closed after the answer. Request and response fields are
SandboxFusion's; ``memory_limit_MB`` becomes the session's memory limit."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.exec import SessionLimits
from kiln.streams.errors import KilnError
from kiln.workers.exec.client import ExecClient
from kiln.workers.gateway.languages import DRIVER, LANGUAGES
from kiln.workers.gateway.settings import GatewaySettings

log = logging.getLogger("kiln.gateway")
router = APIRouter(tags=["SandboxFusion"])
_INLINE_SPEC = 90_000  # characters of base64 spec that still fit in one command; larger specs are written first
_DRIVER_B64 = base64.b64encode(DRIVER.encode()).decode()
_DRIVER_COMMAND = f"python3 -I -c \"import base64; exec(base64.b64decode('{_DRIVER_B64}'))\""


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
    for name in ("compile_timeout", "run_timeout"):
        value = getattr(request, name)
        if not 0 < value <= settings.max_timeout_s:
            raise HTTPException(400, f"{name}={value:g}s is outside kiln's limit (0, {settings.max_timeout_s:g}] "
                                     "(KILN_GATEWAY_MAX_TIMEOUT_S)")
    if request.memory_limit_MB > settings.max_memory_mb:
        raise HTTPException(400, f"memory_limit_MB={request.memory_limit_MB} is over kiln's limit "
                                 f"{settings.max_memory_mb} (KILN_GATEWAY_MAX_MEMORY_MB)")


def encode_spec(request: RunCodeRequest, settings: GatewaySettings) -> str:
    """What the driver needs to run ``request``, as its base64 argument."""
    language = LANGUAGES[request.language]
    files = {_relative(p): c or "" for p, c in request.files.items()}
    files[language.source] = base64.b64encode(request.code.encode()).decode()
    spec = {"files": files, "compile": language.compile, "run": language.run, "stdin": request.stdin,
            "compile_timeout": request.compile_timeout, "run_timeout": request.run_timeout,
            "fetch_files": [_relative(p) for p in request.fetch_files], "max_output": settings.max_output_bytes}
    return base64.b64encode(json.dumps(spec).encode()).decode()


def driver_command(argument: str) -> str:
    """The one command that runs a request in a session: ``argument`` is the spec, or ``spec.json`` holding it."""
    return f"{_DRIVER_COMMAND} {argument}"


async def run_code(exec_client: ExecClient, settings: GatewaySettings, request: RunCodeRequest) -> RunCodeResponse:
    refuse_beyond_limits(request, settings)
    language = LANGUAGES[request.language]
    encoded = encode_spec(request, settings)
    # The exec stage's default limits unless the request sets memory: only those are served from the warm pool.
    limits = SessionLimits()
    if request.memory_limit_MB > 0:
        limits = SessionLimits(memory_mb=max(request.memory_limit_MB, 32))
    try:
        session = await exec_client.open_session(settings.toolchain_image, limits=limits)
    except KilnError as e:
        return RunCodeResponse(status=RunStatus.sandbox_error, message=f"opening a session: {e}")
    try:
        argument = encoded
        if len(encoded) > _INLINE_SPEC:
            await exec_client.write_files(session, {"spec.json": encoded})
            argument = "spec.json"
        budget = (request.compile_timeout if language.compile else 0) + request.run_timeout + 30
        output = await exec_client.run(session, driver_command(argument), timeout_s=budget,
                                       max_output_bytes=settings.exec_output_bytes)
    except KilnError as e:
        return RunCodeResponse(status=RunStatus.sandbox_error, message=str(e))
    finally:
        asyncio.get_running_loop().create_task(_close(exec_client, session))
    try:
        result: dict[str, Any] = json.loads(output.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return RunCodeResponse(status=RunStatus.sandbox_error,
                               message=f"the driver answered no result (exit {output.exit_code}): "
                                       f"{output.stderr[-500:]}")
    steps = [r for r in (result["compile_result"], result["run_result"]) if r is not None]
    ok = result["run_result"] is not None and all(s["return_code"] == 0 for s in steps)
    return RunCodeResponse(status=RunStatus.success if ok else RunStatus.failed,
                           compile_result=result["compile_result"], run_result=result["run_result"],
                           files=result["files"])


async def _close(exec_client: ExecClient, session: Any) -> None:
    try:
        await exec_client.close_session(session)
    except KilnError as e:  # the worker reaps idle sessions anyway
        log.warning("closing session %s: %s", session.session_id, e)


@router.post("/run_code", response_model=RunCodeResponse)
async def run_code_route(body: RunCodeRequest, request: Request) -> RunCodeResponse:
    state = request.app.state
    return await run_code(state.exec_client, state.settings, body)
