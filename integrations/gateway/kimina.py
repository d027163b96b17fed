"""kimina-lean-server's ``/api/check`` (and its older ``/verify``) over kiln's Lean stage: every snippet is one
``run_code`` job, all of a request's snippets in flight at once; the stage's header reuse and REPL pooling apply.
Answers carry the REPL's own response (``messages``, ``sorries``) the way kimina does; kiln's proof states are
references, not REPL numbers, so a sorry's ``proofState`` is left out, and ``infotree``/``reuse`` are accepted and
ignored (README). With ``debug``, each answer carries kimina's ``diagnostics`` from the Lean worker's account of the
snippet's round trip (``LeanResult.usage``): ``repl_uuid`` (the REPL process that served it), ``cpu_max`` (its CPU
in percent of one core) and ``memory_max`` (its resident bytes at their highest) — kimina-lean-server samples the
last two every second, so for a snippet under a second it reports 0 CPU where kiln reports the round trip's
average."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from kiln.integrations.gateway.settings import GatewaySettings
from kiln.schemas.lean import LeanResult, ReplUsage
from kiln.streams.errors import KilnError
from kiln.workers.lean.client import LeanClient

router = APIRouter(tags=["kimina-lean-server"])


class Snippet(BaseModel):
    id: str
    code: str


class CheckRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    snippets: list[Snippet] = Field(min_length=1)
    timeout: int = Field(30, ge=0)
    debug: bool = False
    reuse: bool = True
    infotree: str | None = None


class ReplResponse(BaseModel):
    id: str
    time: float = 0.0
    error: str | None = None
    response: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None


class CheckResponse(BaseModel):
    results: list[ReplResponse]


class Code(BaseModel):
    custom_id: str | int
    proof: str | None = None
    code: str | None = None


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    codes: list[Code] = Field(min_length=1)
    timeout: int = Field(300, ge=0)
    infotree_type: str | None = None
    disable_cache: bool = False


def _repl_response(result: LeanResult) -> dict[str, Any]:
    """The REPL's JSON for one command, from kiln's typed result."""
    if not result.ok and result.error is not None:
        return {"message": result.error}
    response: dict[str, Any] = {"env": 0}
    if result.messages:
        response["messages"] = [m.model_dump(by_alias=True, exclude_none=True) for m in result.messages]
    if result.sorries:
        response["sorries"] = [{"pos": s.pos, "endPos": s.end_pos, "goal": s.goal} for s in result.sorries]
    return response


def diagnostics(usage: ReplUsage | None) -> dict[str, Any] | None:
    """kimina's ``Diagnostics`` (``repl_uuid``, ``cpu_max`` in percent of one core, ``memory_max`` in bytes)."""
    if usage is None:
        return None
    cpu = 100 * usage.cpu_s / usage.seconds if usage.seconds > 0 else 0.0
    return {"repl_uuid": usage.repl, "cpu_max": round(cpu, 1), "memory_max": usage.peak_rss_bytes}


async def check_one(lean: LeanClient, snippet_id: str, code: str, timeout_s: float,
                    debug: bool = False) -> ReplResponse:
    started = time.monotonic()
    try:
        result = await lean.run_code(code, timeout_s=timeout_s)
    except KilnError as e:
        # kimina's clients classify by these words: "timed out" is a timeout, anything else a server error.
        reason = str(e)
        error = f"Lean REPL timed out: {reason}" if "ReplTimeout" in reason else reason
        return ReplResponse(id=snippet_id, time=round(time.monotonic() - started, 4), error=error)
    return ReplResponse(id=snippet_id, time=round(time.monotonic() - started, 4), response=_repl_response(result),
                        diagnostics=diagnostics(result.usage) if debug else None)


def _timeout(requested: int, settings: GatewaySettings) -> float:
    if requested > settings.lean_timeout_s:
        raise HTTPException(400, f"timeout={requested}s is over kiln's limit {settings.lean_timeout_s:g}s "
                                 "(KILN_GATEWAY_LEAN_TIMEOUT_S)")
    return float(requested) if requested > 0 else settings.lean_timeout_s


@router.post("/api/check", response_model=CheckResponse, response_model_exclude_none=True)
async def check(body: CheckRequest, request: Request) -> CheckResponse:
    if len({s.id for s in body.snippets}) != len(body.snippets):
        raise HTTPException(400, "`snippets` must have unique ids")
    timeout_s = _timeout(body.timeout, request.app.state.settings)
    lean: LeanClient = request.app.state.lean_client
    results = await asyncio.gather(*(check_one(lean, s.id, s.code, timeout_s, body.debug) for s in body.snippets))
    return CheckResponse(results=list(results))


@router.post("/verify")
async def verify(body: VerifyRequest, request: Request) -> dict[str, Any]:
    """The older request shape (``codes`` with ``custom_id``), still used by autoformalizer-era clients."""
    timeout_s = _timeout(body.timeout, request.app.state.settings)
    lean: LeanClient = request.app.state.lean_client
    sources = []
    for code in body.codes:
        text = code.proof if code.proof is not None else code.code
        if text is None:
            raise HTTPException(400, f"snippet {code.custom_id!r} has no proof/code content")
        sources.append(text)
    results = await asyncio.gather(*(check_one(lean, str(c.custom_id), text, timeout_s)
                                     for c, text in zip(body.codes, sources, strict=True)))
    answers: list[dict[str, Any]] = []
    for code, result in zip(body.codes, results, strict=True):
        answer: dict[str, Any] = {"custom_id": code.custom_id}
        if result.error is not None:
            answer["error"] = result.error
        else:
            answer["response"] = {**(result.response or {}), "time": result.time}
        answers.append(answer)
    return {"results": answers}
