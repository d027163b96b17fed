"""Client facade of the ``verify`` stage: what a trainer (or an adapter for one) imports.

``VerifyClient.verify(task, completions)`` is one request; ``verify_batch(tasks, completions)`` sends a training
step's batch — one request per distinct task, all in flight at once — and returns the verdicts in the batch's order.
Neither raises for a failed check or a failed request: a request that gets no answer (dead-lettered, expired, lost)
comes back as verdicts with ``failure="unavailable"`` and reward 0, logged. ``BlockingVerifyClient`` is the same for
trainers that call rewards synchronously from their own threads (TRL, verl's reward functions).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import CompletionVerdict, VerifyRequest, VerifyResult
from kiln.streams.client import KilnClient
from kiln.streams.errors import ClientError
from kiln.streams.settings import KilnSettings, get_settings

T = TypeVar("T")
log = logging.getLogger("kiln.verify")
MAX_COMPLETIONS = 4096  # per request (VerifyRequest); longer lists travel as several requests


def unavailable(n: int, reason: str) -> list[CompletionVerdict]:
    return [CompletionVerdict(reward=0.0, failure="unavailable", reason=reason[:2000]) for _ in range(n)]


class VerifyClient:
    """Verify requests over a shared ``KilnClient``."""

    def __init__(self, kiln: KilnClient) -> None:
        self.kiln = kiln

    async def verify(self, task: RolloutTask, completions: Sequence[str], *,
                     deadline_s: float | None = None) -> list[CompletionVerdict]:
        """One verdict per completion, in order; never raises for a failed check or request."""
        if not completions:
            return []
        chunks = [list(completions[i:i + MAX_COMPLETIONS]) for i in range(0, len(completions), MAX_COMPLETIONS)]
        parts = await asyncio.gather(*(self._one(task, chunk, deadline_s) for chunk in chunks))
        return [v for part in parts for v in part]

    async def _one(self, task: RolloutTask, completions: list[str],
                   deadline_s: float | None) -> list[CompletionVerdict]:
        try:
            result: VerifyResult = await self.kiln.call("verify", VerifyRequest(task=task, completions=completions),
                                                        deadline_s=deadline_s)
        except ClientError as e:
            log.warning("task %s: %d completions scored 0, the verify request failed: %s", task.task_id,
                        len(completions), e)
            return unavailable(len(completions), f"{type(e).__name__}: {e}")
        for verdict in result.verdicts:
            if verdict.failure:
                log.info("task %s: a completion scored 0: %s: %s", task.task_id, verdict.failure, verdict.reason)
        return result.verdicts

    async def verify_batch(self, tasks: Sequence[RolloutTask], completions: Sequence[str], *,
                           deadline_s: float | None = None) -> list[CompletionVerdict]:
        """A training step's batch: ``completions[i]`` is checked against ``tasks[i]``; completions of the same
        task (a prompt's group) travel in one request, so the verifier can batch them into one sandbox."""
        if len(tasks) != len(completions):
            raise ValueError(f"{len(tasks)} tasks for {len(completions)} completions")
        groups: dict[str, tuple[RolloutTask, list[int]]] = {}
        keys: dict[int, str] = {}  # by task object: a step's batch repeats each task object once per sample
        for i, task in enumerate(tasks):
            if (key := keys.get(id(task))) is None:
                key = keys[id(task)] = task.model_dump_json()
            groups.setdefault(key, (task, []))[1].append(i)
        answers = await asyncio.gather(*(self.verify(task, [completions[i] for i in at], deadline_s=deadline_s)
                                         for task, at in groups.values()))
        out: list[CompletionVerdict | None] = [None] * len(completions)
        for (_, at), verdicts in zip(groups.values(), answers, strict=True):
            for i, verdict in zip(at, verdicts, strict=True):
                out[i] = verdict
        return [v for v in out if v is not None]


class BlockingVerifyClient:
    """A ``VerifyClient`` on an event loop thread of its own, with one ``KilnClient`` for its lifetime: for trainers
    that call rewards synchronously, from any thread. ``run`` runs any coroutine on that loop and waits for it (TRL's
    reward functions run kiln's verifiers in process on this same loop and client); ``submit`` awaits one from
    another event loop. kiln's one bridge from synchronous callers to its asyncio clients."""

    def __init__(self, settings: KilnSettings | None = None, client_id: str | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-verify", daemon=True)
        self._thread.start()
        self.kiln = KilnClient(settings or get_settings(),
                               client_id or f"verify-client.{socket.gethostname()}.{os.getpid()}")
        self.client = VerifyClient(self.kiln)

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
