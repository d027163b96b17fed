"""Job policies as composable middleware (as in dramatiq): each wraps the next and may short-circuit.

A middleware is ``async def __call__(job, call_next) -> Outcome``. The runtime composes
``[Metrics, Deadline, Retry, Timeout]`` around the handler by default; a deployment may add or reorder pieces.
Handlers raise; only the innermost piece (``stage_chain``'s handler call) turns a return value into an ``Outcome``.

"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from kiln.schemas.envelope import ErrorInfo, ResultStatus
from kiln.streams import cancel, codec
from kiln.streams.blobstore import BlobStore
from kiln.streams.cancel import CancelToken
from kiln.streams.errors import PermanentJobError, RoutineJobError, TransientJobError
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.stage import JobContext, Stage


@dataclass
class Job:
    stage: Stage
    ctx: JobContext
    started: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    status: ResultStatus
    result: BaseModel | None = None
    error: ErrorInfo | None = None
    attempts: int = 1
    dead_letter: bool = False


Next = Callable[[Job], Awaitable[Outcome]]


class Middleware(Protocol):
    async def __call__(self, job: Job, call_next: Next) -> Outcome: ...


def error_info(exc: BaseException, retryable: bool) -> ErrorInfo:
    return ErrorInfo(type=type(exc).__name__, message=str(exc)[:2000] or type(exc).__name__, retryable=retryable)


class DeadlineMiddleware:
    """A job whose deadline passed before it started is answered 'expired' and never run (the deadline measured as
    a duration from the broker's timestamp where the context has one: ``JobContext.expires_at``)."""

    async def __call__(self, job: Job, call_next: Next) -> Outcome:
        ends = job.ctx.expires_at
        if time.time() >= ends if ends is not None else job.ctx.envelope.expired():
            return Outcome("expired", error=ErrorInfo(type="RequestExpired", message="deadline passed before start"),
                           attempts=0)
        return await call_next(job)


class TimeoutMiddleware:
    """Bounds one attempt's wall time; a timeout is transient (the retry policy decides what follows).
    ``override_s`` (``KILN_JOB_TIMEOUT_S``) replaces the stage's own limit."""

    def __init__(self, override_s: float | None = None) -> None:
        self.override_s = override_s

    async def __call__(self, job: Job, call_next: Next) -> Outcome:
        limit = self.override_s or job.stage.job_timeout_s
        if limit is None:
            return await call_next(job)
        try:
            return await asyncio.wait_for(call_next(job), limit)
        except TimeoutError:
            raise TransientJobError(f"attempt exceeded {limit:g}s") from None


class RetryMiddleware:
    """Retries transient failures with jittered exponential backoff; permanent ones and exhausted retries go to
    the DLQ. Unknown exceptions count as transient: a bug shows up in the DLQ after the limit, never lost."""

    def __init__(self, backoff_s: float = 0.2, max_backoff_s: float = 5.0) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def total_backoff_s(self, attempts: int) -> float:
        """The longest the waits between ``attempts`` attempts can add up to."""
        return float(sum(min(self.max_backoff_s, self.backoff_s * 2 ** (k - 1)) for k in range(1, attempts)))

    async def __call__(self, job: Job, call_next: Next) -> Outcome:
        limit = max(1, job.stage.max_attempts)
        while True:
            job.ctx.attempt += 1
            job.ctx.cancel = CancelToken()  # an earlier attempt's cancellation is not this one's
            try:
                outcome = await call_next(job)
                outcome.attempts = job.ctx.attempt
                return outcome
            except RoutineJobError as e:
                return Outcome("error", error=error_info(e, False), attempts=job.ctx.attempt)
            except PermanentJobError as e:
                return Outcome("error", error=error_info(e, False), attempts=job.ctx.attempt, dead_letter=True)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if job.ctx.attempt >= limit:
                    return Outcome("error", error=error_info(e, True), attempts=job.ctx.attempt, dead_letter=True)
                delay = self.total_backoff_s(job.ctx.attempt + 1) - self.total_backoff_s(job.ctx.attempt)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))


class MetricsMiddleware:
    """Durations (from the job's start), completions by status, failures by reason."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    async def __call__(self, job: Job, call_next: Next) -> Outcome:
        outcome = await call_next(job)  # an outcome answered early is measured too
        self.metrics.job_finished(job.stage.name, outcome.status, time.monotonic() - job.started,
                                  outcome.error.type if outcome.error else None, outcome.dead_letter)
        return outcome


def default_middleware(metrics: WorkerMetrics, job_timeout_s: float | None = None) -> list[Middleware]:
    return [MetricsMiddleware(metrics), DeadlineMiddleware(), RetryMiddleware(), TimeoutMiddleware(job_timeout_s)]


def stage_chain(stage: Stage, middleware: Sequence[Middleware], blob_store: BlobStore | None) -> Next:
    """The middleware around the stage's handler: decode the typed request (claim checks resolved), call it."""

    async def invoke_handler(job: Job) -> Outcome:
        envelope, model = job.ctx.envelope, stage.spec.request_model
        # A claim check is blob-store I/O: off the event loop; an inline payload is validated in place.
        request = (await asyncio.to_thread(codec.request_payload, envelope, model, blob_store) if envelope.claim_check
                   else codec.request_payload(envelope, model, blob_store))
        mark = cancel.enter(job.ctx.cancel)
        try:
            return Outcome("ok", result=await stage.handler(request, job.ctx))
        finally:
            cancel.leave(mark)

    return compose(middleware, invoke_handler)


def compose(middleware: Sequence[Middleware], innermost: Next) -> Next:
    """``middleware[0]`` runs first and wraps all the others."""
    chain = innermost
    for mw in reversed(middleware):
        chain = _bind(mw, chain)
    return chain


def _bind(mw: Middleware, call_next: Next) -> Next:
    async def run(job: Job) -> Outcome:
        return await mw(job, call_next)

    return run
