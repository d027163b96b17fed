"""Client facade of the ``verify`` stage: what a trainer (or an adapter for one) imports.

``VerifyClient.verify(task, completions)`` is one request; ``verify_batch(tasks, completions)`` sends a training
step's batch — its groups (one per distinct task) in one request (``VerifyRequest.groups``; a big step in a few,
all in flight at once) — and returns the verdicts in the batch's order.
Neither raises for a failed check or a failed request. What kiln failed to judge (a ``failure``: its sandbox,
checker, worker or the stage failed it; a request that got no answer comes back as ``unavailable``) is checked again,
each time as a new request — so on another verify worker, exec worker and runner — within the budget of
``VerifySettings`` (``KILN_VERIFY_RETRY_ATTEMPTS``, ``_RETRY_BUDGET_S``, ``_RETRY_BACKOFF_S``: ``rechecked``); what is
still kiln's failure after it is reported as such (no reward, logged), never as a 0. ``BlockingVerifyClient`` is the
same for trainers that call rewards synchronously from their own threads (TRL, verl's reward functions).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import (
    MAX_COMPLETIONS,
    CompletionVerdict,
    SentTogether,
    VerifyGroup,
    VerifyRequest,
    VerifyResult,
)
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.errors import ClientError
from kiln.streams.settings import KilnSettings, get_settings


class VerifySettings(BaseSettings):
    """``KILN_VERIFY_*``: what a verify worker's verifiers keep in flight (``exec_*``), and for the stage's clients
    the retry budget of what kiln failed to judge (``retry_*``) and how long an adapter imputing a group's mean waits
    for the group (``group_wait_s``)."""

    model_config = SettingsConfigDict(env_prefix="KILN_VERIFY_", extra="ignore")

    exec_calls: int = Field(8, ge=1, description="Exec run_once calls a worker's verifiers keep in flight.")
    exec_batch_groups: int = Field(32, ge=1, description="Requests one exec checker call may verify together.")
    exec_batch_window_s: float = Field(0.02, ge=0, description="The longest a checker call's batch gathers "
                                                                "requests while they keep coming (a lone request "
                                                                "goes at once).")
    exec_batch_quiet_s: float = Field(0.005, ge=0, description="A gathering batch goes once no request has joined "
                                                                "it for this long.")
    retry_attempts: int = Field(4, ge=1, description="Checks a client makes of a completion kiln failed to judge "
                                                     "(sandbox, checker, worker or stage failed), each a new request "
                                                     "(another verify worker, exec worker and runner), before it "
                                                     "reports it without a reward; 1: no retry.")
    retry_budget_s: float = Field(60.0, gt=0, description="How long after its first answer a client may still "
                                                          "retry: keep it under the trainer's own reward timeout "
                                                          "(OpenRLHF's remote reward model: 180 s).")
    retry_backoff_s: float = Field(1.0, ge=0, description="The wait before the first retry; it doubles after each.")
    group_wait_s: float = Field(30.0, gt=0, description="Where a trainer has no per-sample \"no reward\" (verl, "
                                                        "OpenRLHF) and kiln gives an unjudged completion its group's "
                                                        "mean: how long it waits for the rest of its group.")


T = TypeVar("T")
log = logging.getLogger("kiln.verify")
STEP_COMPLETIONS = 1024
"""Completions a step's request (``verify_batch``) carries at most: a bigger step travels as several requests, sent
together, each answered by a result small enough to need no claim check (a verdict is ~0.2 KB of JSON)."""


RETRIED = frozenset({"timeout", "sandbox_error", "checker_error", "unavailable"})
"""kiln's failures worth another check (``invalid_task`` is not: the task reads the same every time)."""
Check = Callable[[RolloutTask, list[str]], Awaitable[list[CompletionVerdict]]]
"""Verdicts for a task's completions, one each, in order (a verify request, or the verifiers run in process)."""


def unavailable(n: int, reason: str) -> list[CompletionVerdict]:
    return [CompletionVerdict(reward=0.0, failure="unavailable", reason=reason[:2000]) for _ in range(n)]


async def rechecked(check: Check, task: RolloutTask, completions: list[str], settings: VerifySettings,
                    deadline: float | None = None) -> list[CompletionVerdict]:
    """``check`` the completions, then again — each time a new request — those kiln failed to judge (``RETRIED``),
    after ``retry_backoff_s`` (doubling), until each has a real verdict, ``retry_attempts`` checks were made or the
    next would start past ``retry_budget_s`` after the first answer (or past ``deadline``, a ``time.monotonic()``).
    A verdict's ``attempts`` says how many checks it took; what is still kiln's failure is logged and returned as
    such."""
    verdicts = list(await check(task, completions))
    end = min(time.monotonic() + settings.retry_budget_s, deadline if deadline is not None else float("inf"))
    attempt = 1
    while attempt < settings.retry_attempts:
        again = [i for i, v in enumerate(verdicts) if v.failure in RETRIED]
        delay = settings.retry_backoff_s * 2 ** (attempt - 1)
        if not again or time.monotonic() + delay > end:
            break
        await asyncio.sleep(delay)
        attempt += 1
        for i, verdict in zip(again, await check(task, [completions[i] for i in again]), strict=True):
            verdicts[i] = verdict.model_copy(update={"attempts": attempt})
    failed = [v for v in verdicts if v.failure]
    if failed:
        log.warning("task %s: %d of %d completions got no verdict (no reward) after %d checks: %s: %s",
                    task.task_id, len(failed), len(verdicts), attempt, failed[0].failure, failed[0].reason)
    return verdicts


class VerifyClient:
    """Verify requests over a shared ``KilnClient``; ``settings``: the retry budget (default: ``KILN_VERIFY_*``)."""

    def __init__(self, kiln: KilnClient, settings: VerifySettings | None = None) -> None:
        self.kiln = kiln
        self.settings = settings or VerifySettings()

    async def verify(self, task: RolloutTask, completions: Sequence[str], *, deadline_s: float | None = None,
                     sent_together: SentTogether | None = None) -> list[CompletionVerdict]:
        """One verdict per completion, in order; never raises for a failed check or request. kiln's failures are
        retried within the budget (``rechecked``). ``sent_together``: the requests this one goes with (its first
        check; a re-check goes alone)."""
        if not completions:
            return []
        deadline = time.monotonic() + deadline_s if deadline_s is not None else None
        return await self._checked(task, list(completions), deadline,
                                   lambda first: self._sent(task, first, deadline, sent_together))

    async def _checked(self, task: RolloutTask, completions: list[str], deadline: float | None,
                       first: Callable[[list[str]], Awaitable[list[CompletionVerdict]]]) -> list[CompletionVerdict]:
        """``rechecked``: the first check by ``first``, each re-check a request of its own."""
        opening = [first]

        async def check(task: RolloutTask, completions: list[str]) -> list[CompletionVerdict]:
            if opening:
                return await opening.pop()(completions)
            return await self._sent(task, completions, deadline, None)

        return await rechecked(check, task, completions, self.settings, deadline)

    async def _sent(self, task: RolloutTask, completions: list[str], deadline: float | None,
                    together: SentTogether | None) -> list[CompletionVerdict]:
        """One check of the task's completions: a request (several past ``MAX_COMPLETIONS``, all in flight)."""
        left = _left(deadline)
        chunks = [completions[i:i + MAX_COMPLETIONS] for i in range(0, len(completions), MAX_COMPLETIONS)]
        parts = await asyncio.gather(*(self._one(VerifyRequest(task=task, completions=chunk, sent_together=together),
                                                 [len(chunk)], left) for chunk in chunks))
        return [v for part in parts for v in part[0]]

    async def _one(self, request: VerifyRequest, counts: list[int],
                   deadline_s: float | None) -> list[list[CompletionVerdict]]:
        """The verdicts of the request's groups (``counts`` completions each); what kiln failed to answer as
        ``unavailable``."""
        try:
            result: VerifyResult = await self.kiln.call("verify", request, deadline_s=deadline_s)
        except ClientError as e:
            log.info("a verify request for %d completions failed: %s", sum(counts), e)
            return [unavailable(n, f"{type(e).__name__}: {e}") for n in counts]
        verdicts = result.by_group()
        if [len(v) for v in verdicts] != counts:
            log.warning("a verify result has %s verdicts for groups of %s completions", [len(v) for v in verdicts],
                        counts)
            return [unavailable(n, "the result's verdicts do not match the request's groups") for n in counts]
        return verdicts

    async def verify_batch(self, tasks: Sequence[RolloutTask], completions: Sequence[str], *,
                           deadline_s: float | None = None) -> list[CompletionVerdict]:
        """A training step's batch: ``completions[i]`` is checked against ``tasks[i]``. Completions of the same task
        (a prompt's group) are one group; the step's groups travel together, in requests of up to
        ``STEP_COMPLETIONS`` completions (a group above it alone), so the stage gets one message per step and the
        verifier batches the groups into as few sandboxes as it may. A group's re-checks go alone."""
        if len(tasks) != len(completions):
            raise ValueError(f"{len(tasks)} tasks for {len(completions)} completions")
        groups: dict[str, tuple[RolloutTask, list[int]]] = {}
        keys: dict[int, str] = {}  # by task object: a step's batch repeats each task object once per sample
        for i, task in enumerate(tasks):
            if (key := keys.get(id(task))) is None:
                key = keys[id(task)] = task.model_dump_json()
            groups.setdefault(key, (task, []))[1].append(i)
        deadline = time.monotonic() + deadline_s if deadline_s is not None else None
        steps: list[list[tuple[RolloutTask, list[str]]]] = []
        size = STEP_COMPLETIONS
        for task, at in groups.values():
            if size + len(at) > STEP_COMPLETIONS:
                steps.append([])
                size = 0
            steps[-1].append((task, [completions[i] for i in at]))
            size += len(at)
        # Sent as more than one request, they say so (counting the verifier calls their groups make).
        chunks = [len(step) if len(step) > 1 else -(-len(step[0][1]) // MAX_COMPLETIONS) for step in steps]
        requests = sum(1 if len(step) > 1 else n for step, n in zip(steps, chunks, strict=True))
        together = SentTogether(id=uuid.uuid4().hex, requests=sum(chunks)) if requests > 1 else None

        async def sent(step: list[tuple[RolloutTask, list[str]]]) -> list[list[CompletionVerdict]]:
            if len(step) == 1:
                return [await self._sent(step[0][0], step[0][1], deadline, together)]
            request = VerifyRequest(groups=[VerifyGroup(task=t, completions=c) for t, c in step],
                                    sent_together=together)
            return await self._one(request, [len(c) for _, c in step], _left(deadline))

        pairs = [pair for step in steps for pair in step]
        answers = [verdicts for answer in await asyncio.gather(*(sent(step) for step in steps)) for verdicts in answer]

        def given(verdicts: list[CompletionVerdict]) -> Callable[[list[str]], Awaitable[list[CompletionVerdict]]]:
            async def first(_completions: list[str]) -> list[CompletionVerdict]:
                return verdicts
            return first

        # A group with a verdict kiln failed to give is checked again (alone), within the budget (``rechecked``).
        failed = [i for i, verdicts in enumerate(answers) if any(v.failure for v in verdicts)]
        rechecks = await asyncio.gather(*(self._checked(*pairs[i], deadline, given(answers[i])) for i in failed))
        for i, verdicts in zip(failed, rechecks, strict=True):
            answers[i] = verdicts
        out: list[CompletionVerdict | None] = [None] * len(completions)
        for (_, at), verdicts in zip(groups.values(), answers, strict=True):
            for i, verdict in zip(at, verdicts, strict=True):
                out[i] = verdict
        return [v for v in out if v is not None]


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (a ``time.monotonic()``), at least a millisecond; None without one."""
    return None if deadline is None else max(0.001, deadline - time.monotonic())


class BlockingVerifyClient:
    """A ``VerifyClient`` on an event loop thread of its own, with one ``KilnClient`` for its lifetime: for trainers
    that call rewards synchronously, from any thread. ``run`` runs any coroutine on that loop and waits for it (TRL's
    reward functions run kiln's verifiers in process on this same loop and client); ``submit`` awaits one from
    another event loop. kiln's one bridge from synchronous callers to its asyncio clients."""

    def __init__(self, settings: KilnSettings | None = None, client_id: str | None = None,
                 verify: VerifySettings | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-verify", daemon=True)
        self._thread.start()
        settings = settings or get_settings()
        # The deployment's blob store, as the gateway opens it: results above KILN_CLAIM_CHECK_BYTES (a big batch's
        # verdicts; for the TRL rewards in process, an exec check's output) come back as claim checks.
        self.kiln = KilnClient(settings, client_id or f"verify-client.{socket.gethostname()}.{os.getpid()}",
                               blob_store=open_blob_store(settings))
        self.client = VerifyClient(self.kiln, verify)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def submit(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Await ``coroutine`` on this client's loop from another event loop (an async trainer's)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    def verify(self, task: RolloutTask, completions: Sequence[str]) -> list[CompletionVerdict]:
        return self.run(self.client.verify(task, completions))

    def verify_batch(self, tasks: Sequence[RolloutTask], completions: Sequence[str]) -> list[CompletionVerdict]:
        return self.run(self.client.verify_batch(tasks, completions))

    def close(self) -> None:
        self.run(self.kiln.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
