"""Job policies as composable middleware (as in dramatiq): each wraps the next and may short-circuit.

A middleware is ``async def __call__(job, call_next) -> Outcome``. The runtime composes
``[Metrics, Deadline, Retry, Timeout]`` around the handler by default; a deployment may add or reorder pieces.
Handlers raise; only the innermost piece (``stage_chain``'s handler call) turns a return value into an ``Outcome``.

The default pieces are ``Policy`` objects: their work splits into ``begin`` (before the handler), ``end`` (after it
succeeded) and ``resume`` (the rest of the job once its attempt is under way). A worker applies ``begin`` and
``end`` without a coroutine to jobs whose non-blocking handler completes in its first step, and hands anything else
(an attempt that raised or waits) to the ``resume`` chain, which behaves exactly as ``__call__`` would have.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class Policy:
    """A middleware in three steps (see the module's docstring); ``__call__`` is ``begin`` then ``resume``. An
    outcome from ``begin`` answers the job without running the handler (the policies outside it still see it)."""

    def begin(self, job: Job) -> Outcome | None:
        del job
        return None

    def end(self, job: Job, outcome: Outcome) -> Outcome:
        del job
        return outcome

    async def resume(self, job: Job, attempt: Awaitable[Outcome], call_next: Next) -> Outcome:
        """Finish the job whose ``call_next(job)`` is ``attempt``, already under way."""
        del call_next
        return self.end(job, await attempt)

    async def __call__(self, job: Job, call_next: Next) -> Outcome:
        early = self.begin(job)
        if early is not None:
            return early
        return await self.resume(job, call_next(job), call_next)


class DeadlineMiddleware(Policy):
    """A job whose deadline passed before it started is answered 'expired' and never run (the deadline measured as
    a duration from the broker's timestamp where the context has one: ``JobContext.expires_at``)."""

    def begin(self, job: Job) -> Outcome | None:
        ends = job.ctx.expires_at
        if time.time() >= ends if ends is not None else job.ctx.envelope.expired():
            return Outcome("expired", error=ErrorInfo(type="RequestExpired", message="deadline passed before start"),
                           attempts=0)
        return None


class TimeoutMiddleware(Policy):
    """Bounds one attempt's wall time; a timeout is transient (the retry policy decides what follows).
    ``override_s`` (``KILN_JOB_TIMEOUT_S``) replaces the stage's own limit. An attempt that completes in its first
    step (inline) has nothing to bound: the loop could not have interrupted it either."""

    def __init__(self, override_s: float | None = None) -> None:
        self.override_s = override_s

    async def resume(self, job: Job, attempt: Awaitable[Outcome], call_next: Next) -> Outcome:
        limit = self.override_s or job.stage.job_timeout_s
        if limit is None:
            return await attempt
        try:
            return await asyncio.wait_for(attempt, limit)
        except TimeoutError:
            raise TransientJobError(f"attempt exceeded {limit:g}s") from None


class RetryMiddleware(Policy):
    """Retries transient failures with jittered exponential backoff; permanent ones and exhausted retries go to
    the DLQ. Unknown exceptions count as transient: a bug shows up in the DLQ after the limit, never lost."""

    def __init__(self, backoff_s: float = 0.2, max_backoff_s: float = 5.0) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def total_backoff_s(self, attempts: int) -> float:
        """The longest the waits between ``attempts`` attempts can add up to."""
        return float(sum(min(self.max_backoff_s, self.backoff_s * 2 ** (k - 1)) for k in range(1, attempts)))

    def begin(self, job: Job) -> Outcome | None:
        job.ctx.attempt += 1
        job.ctx.cancel = CancelToken()  # an earlier attempt's cancellation is not this one's
        return None

    def end(self, job: Job, outcome: Outcome) -> Outcome:
        outcome.attempts = job.ctx.attempt
        return outcome

    async def resume(self, job: Job, attempt: Awaitable[Outcome], call_next: Next) -> Outcome:
        limit = max(1, job.stage.max_attempts)
        while True:
            try:
                return self.end(job, await attempt)
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
            self.begin(job)
            attempt = call_next(job)


class MetricsMiddleware(Policy):
    """Durations (from the job's start), completions by status, failures by reason."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def end(self, job: Job, outcome: Outcome) -> Outcome:
        self.metrics.job_finished(job.stage.name, outcome.status, time.monotonic() - job.started,
                                  outcome.error.type if outcome.error else None, outcome.dead_letter)
        return outcome

    async def __call__(self, job: Job, call_next: Next) -> Outcome:
        return self.end(job, await call_next(job))  # an outcome answered early is measured too


def default_middleware(metrics: WorkerMetrics, job_timeout_s: float | None = None) -> list[Middleware]:
    return [MetricsMiddleware(metrics), DeadlineMiddleware(), RetryMiddleware(), TimeoutMiddleware(job_timeout_s)]


def stage_chain(stage: Stage, middleware: Sequence[Middleware], blob_store: BlobStore | None) -> Next:
    """The middleware around the stage's handler: decode the typed request (claim checks resolved), call it."""
    return compose(middleware, _invoker(stage, blob_store))


def _invoker(stage: Stage, blob_store: BlobStore | None) -> Next:
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

    return invoke_handler


class InlineChain:
    """A chain of ``Policy`` objects applied to a job without a coroutine each (see the module's docstring), for a
    stage whose handler is non-blocking. Only for requests without a claim check (fetching one is I/O)."""

    def __init__(self, stage: Stage, policies: Sequence[Policy], blob_store: BlobStore | None) -> None:
        self.stage = stage
        self.policies = tuple(policies)
        invoke = _invoker(stage, blob_store)
        # What each policy's resume calls for a further attempt: the policies inside it, then the handler.
        self._inner = [compose(self.policies[i + 1:], invoke) for i in range(len(self.policies))]

    @staticmethod
    def of(stage: Stage, middleware: Sequence[Middleware], blob_store: BlobStore | None) -> InlineChain | None:
        """The inline form of ``stage_chain(stage, middleware, ...)``; None unless the stage declares its handler
        non-blocking and every piece is a ``Policy``."""
        policies = [mw for mw in middleware if isinstance(mw, Policy)]
        if not stage.nonblocking or len(policies) != len(middleware):
            return None
        return InlineChain(stage, policies, blob_store)

    def attempt(self, job: Job) -> Outcome | Underway:
        """The job's outcome, when the policies and the handler's first step settle it; else its first attempt, under
        way (it raised or waits): ``resume`` ends the job from there as ``stage_chain`` would have."""
        for depth, policy in enumerate(self.policies):
            early = policy.begin(job)
            if early is not None:
                return self._end(job, early, depth)
        try:
            underway = self._first_step(job)
        except Exception as e:  # the policies' resume decide, as they would for the handler's coroutine raising it
            return _Raised(e)
        if isinstance(underway, Outcome):
            return self._end(job, underway, len(self.policies))
        return underway

    def _end(self, job: Job, outcome: Outcome, depth: int) -> Outcome:
        for policy in reversed(self.policies[:depth]):
            outcome = policy.end(job, outcome)
        return outcome

    async def resume(self, job: Job, underway: Underway) -> Outcome:
        attempt: Awaitable[Outcome] = underway
        for policy, inner in zip(reversed(self.policies), reversed(self._inner), strict=True):
            attempt = policy.resume(job, attempt, inner)
        return await attempt

    def _first_step(self, job: Job) -> Outcome | _Suspended:
        request = codec.request_payload(job.ctx.envelope, self.stage.spec.request_model, None)
        steps = self.stage.handler(request, job.ctx).__await__()
        mark = cancel.enter(job.ctx.cancel)
        try:
            waits_on = steps.send(None)
        except StopIteration as done:
            return Outcome("ok", result=done.value)
        finally:
            cancel.leave(mark)
        return _Suspended(steps, waits_on, job.ctx.cancel)


class _Raised:
    """An attempt whose first step raised: awaiting it raises that."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __await__(self) -> Generator[Any, Any, Outcome]:
        raise self.error
        yield  # (a generator, as ``__await__`` must return)


class _Suspended:
    """An attempt whose first step ran inline and waits on ``waits_on``: awaiting this hands that to the awaiting
    task and drives the handler on from there, cancellation thrown into it. Each step runs under the attempt's
    token (``cancel.current()``), set and reset around it: the steps may run in another task's context than the
    first one did (a timeout's ``wait_for`` runs its own task)."""

    def __init__(self, steps: Generator[Any, None, BaseModel], waits_on: Any, token: cancel.CancelToken) -> None:
        self.steps, self.waits_on, self.token = steps, waits_on, token

    def __await__(self) -> Generator[Any, Any, Outcome]:
        steps, waits_on = self.steps, self.waits_on
        while True:
            try:
                sent = yield waits_on
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as e:
                step = functools.partial(steps.throw, e)
            else:
                step = functools.partial(steps.send, sent)
            mark = cancel.enter(self.token)
            try:
                waits_on = step()
            except StopIteration as done:
                return Outcome("ok", result=done.value)
            finally:
                cancel.leave(mark)


Underway = _Raised | _Suspended
"""A job's first attempt, started inline, that needs more than its first step (it is awaited, once)."""


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
