"""``sleep``: holds a slot for a given time (sleeping, or spinning a CPU), and fails on request.

Failures: ``transient`` and ``permanent`` raise the matching job error; ``crash`` kills the whole worker process
with SIGKILL (as a preempted node would); ``hang`` never returns (the timeout policy must end it). With
``fail_attempts=N`` only the first N attempts fail, so retries can be seen to succeed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.builtin import SleepRequest, SleepResult
from kiln.streams.errors import PermanentJobError, TransientJobError
from kiln.streams.stage import JobContext, Stage
from kiln.workers.builtin import spec


class SleepSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_SLEEP_")

    journal: Path | None = Field(None, description="Append 'start|end|stopped <request_id> <worker> <attempt> <time>' "
                                                   "lines (how tests and benchmarks count executions).")
    poison_tags: list[str] = Field(default_factory=list, description="Tags this worker fails permanently (JSON "
                                   "list): a defect of the deployed worker, fixed by deploying one without it and "
                                   "re-driving the dead letters (kiln dlq redrive).")


_settings = SleepSettings()


def _journal(event: str, ctx: JobContext) -> None:
    if _settings.journal is not None:
        with _settings.journal.open("a") as f:
            f.write(f"{event} {ctx.envelope.request_id} {ctx.worker_id} {ctx.attempt} {time.time():.6f}\n")


def _spin(seconds: float, ctx: JobContext) -> None:
    """Burn a CPU in a job thread, until done or until the job is given up (then say so in the journal)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if ctx.cancel.cancelled.is_set():
            _journal("stopped", ctx)
            return


async def handle(request: SleepRequest, ctx: JobContext) -> SleepResult:
    _journal("start", ctx)
    if request.tag and request.tag in _settings.poison_tags:
        raise PermanentJobError(f"this worker cannot handle tag {request.tag!r} (KILN_SLEEP_POISON_TAGS)")
    failing = request.fail != "none" and ctx.attempt <= request.fail_attempts
    if failing and request.fail == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if request.mode == "spin":
        await ctx.cancel.run(_spin, request.seconds, ctx)
    else:
        await asyncio.sleep(request.seconds)
    if failing:
        if request.fail == "transient":
            raise TransientJobError(f"requested transient failure (attempt {ctx.attempt})")
        if request.fail == "permanent":
            raise PermanentJobError("requested permanent failure")
        if request.fail == "hang":
            await asyncio.Event().wait()
    _journal("end", ctx)
    return SleepResult(slept=request.seconds, attempt=ctx.attempt, tag=request.tag, worker=ctx.worker_id)


stage = Stage(spec.sleep, handle, job_timeout_s=300.0, max_attempts=3)
