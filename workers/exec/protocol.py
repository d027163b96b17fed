"""The runners' wire protocol: a ``run_once`` call as the supervisor (``supervisor/main.go``) reads it — one JSON
line: files to write, steps to run, environment, working directory, output caps, paths to fetch back — and its
answer's steps and files as kiln reads them. ``runners.Runner.call`` carries the line there and back."""

from __future__ import annotations

import base64
from typing import Any

from kiln.schemas.exec import ExecRequest, RunStep, StepOutput
from kiln.workers.exec.sessions import safe_path

MAX_FETCH_BYTES = 16 << 20  # files a run_once call fetches back, in all


def call_message(request: ExecRequest, steps: list[RunStep], env: dict[str, str], fetch: list[str]) -> dict[str, Any]:
    """The call the supervisor runs for ``request``: its files, ``steps``, ``env`` and the paths to ``fetch``."""
    return {"files": [{"path": safe_path(f.path), "mode": f.mode,
                       "data": f.content_b64 if f.text is None else base64.b64encode(f.text.encode()).decode()}
                      for f in request.files],
            "steps": [{"name": s.name, "command": s.command, "timeout_ms": int(s.timeout_s * 1000),
                       "always": s.always,
                       "stdin": None if s.stdin is None else base64.b64encode(s.stdin.encode()).decode()}
                      for s in steps],
            "env": env, "cwd": safe_path(request.cwd) if request.cwd else "",
            "cap": request.max_output_bytes, "fetch": fetch, "fetch_cap": MAX_FETCH_BYTES}


def step_output(step: dict[str, Any]) -> StepOutput:
    """The supervisor's measure of a step: a step ended by a signal exits 128 + signal, as a shell reports it."""
    signal_ = int(step.get("signal") or 0) or None
    code = step.get("exit_code")
    if code is None and signal_ is not None:
        code = 128 + signal_
    return StepOutput(name=str(step["name"]), exit_code=code, signal=signal_, timed_out=bool(step.get("timed_out")),
                      stdout=base64.b64decode(step.get("stdout") or "").decode(errors="replace"),
                      stderr=base64.b64decode(step.get("stderr") or "").decode(errors="replace"),
                      stdout_truncated=bool(step.get("stdout_truncated")),
                      stderr_truncated=bool(step.get("stderr_truncated")),
                      duration_s=round(int(step.get("wall_us") or 0) / 1e6, 4),
                      cpu_s=round(int(step.get("cpu_us") or 0) / 1e6, 4))


def fetched_files(answer: dict[str, Any]) -> dict[str, bytes]:
    """The files the call fetched back, by path."""
    return {path: base64.b64decode(data) for path, data in (answer.get("files") or {}).items()}
