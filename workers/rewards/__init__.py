"""Reward functions for TRL's ``GRPOTrainer`` (and anything that calls ``f(completions, **columns) -> list[float]``),
computed by kiln: every completion of a batch is one set of kiln jobs, all in flight at once, so a batch of 512
runs in parallel across the exec or Lean workers. A reward object owns one ``KilnClient`` on a background event loop
(TRL calls rewards synchronously, from its own thread)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kiln.schemas.exec import SessionLimits
from kiln.streams.client import KilnClient
from kiln.streams.errors import KilnError
from kiln.streams.settings import KilnSettings, get_settings
from kiln.workers.exec.client import ExecClient
from kiln.workers.lean.client import LeanClient

T = TypeVar("T")
log = logging.getLogger("kiln.rewards")
_PATCH = re.compile(r"<patch>\n?(.*?)</patch>|```(?:diff|patch)\n(.*?)```", re.DOTALL)


def completion_text(completion: Any) -> str:
    """TRL passes strings, or for conversational datasets a list of messages: the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is a string or a list of messages, not {type(completion).__name__}")


class _Background:
    """One event loop thread and one ``KilnClient`` for a reward object's lifetime."""

    def __init__(self, settings: KilnSettings | None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-rewards", daemon=True)
        self._thread.start()
        self.kiln = KilnClient(settings or get_settings(), f"rewards.{socket.gethostname()}.{os.getpid()}")

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        self.run(self.kiln.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class TestsPassRatio:
    """Reward = the share of the repository's tests that pass with the completion's patch applied (``<patch>…
    </patch>``, a ```diff fence, or the whole text), each completion in its own exec session on ``image`` (a
    builder-built image of the revision; a dataset column ``image`` overrides it per row). A patch that does not
    apply, or a run without tests, scores 0."""

    __name__ = "kiln_tests_pass_ratio"  # TRL logs rewards under their functions' names
    __test__ = False  # not a pytest class, despite the name

    def __init__(self, image: str | None = None, *, settings: KilnSettings | None = None,
                 timeout_s: float = 600.0, limits: SessionLimits | None = None) -> None:
        self.image, self.timeout_s, self.limits = image, timeout_s, limits or SessionLimits()
        self._background = _Background(settings)
        self._exec = ExecClient(self._background.kiln)

    def __call__(self, completions: list[Any], **columns: Any) -> list[float]:
        images = columns.get("image") or [self.image] * len(completions)
        if any(image is None for image in images):
            raise ValueError("TestsPassRatio needs an image: pass one, or give the dataset an 'image' column")
        jobs = [self._score(completion_text(c), str(image)) for c, image in zip(completions, images, strict=True)]
        return self._background.run(_gather(jobs))

    async def _score(self, text: str, image: str) -> float:
        found = _PATCH.search(text)
        patch = next(g for g in found.groups() if g is not None) if found else text
        session = await self._exec.open_session(image, limits=self.limits)
        try:
            if (await self._exec.apply_patch(session, patch)).exit_code != 0:
                return 0.0
            report = (await self._exec.run_tests(session, timeout_s=self.timeout_s)).tests
        finally:
            await self._exec.close_session(session)
        total = report.passed + report.failed + report.errors if report else 0
        return report.passed / total if report and total else 0.0

    def close(self) -> None:
        self._background.close()


class LeanProofAccepted:
    """Reward = 1 when Lean accepts the proof without ``sorry``: the completion, after the row's ``statement``
    column when the dataset has one (``theorem t : p → p := by`` + the completion), runs as one Lean-stage
    ``run_code``."""

    __name__ = "kiln_lean_proof_accepted"

    def __init__(self, *, settings: KilnSettings | None = None, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._background = _Background(settings)
        self._lean = LeanClient(self._background.kiln)

    def __call__(self, completions: list[Any], **columns: Any) -> list[float]:
        statements = columns.get("statement") or [""] * len(completions)
        jobs = [self._score(f"{s} {completion_text(c)}".strip()) for c, s in zip(completions, statements,
                                                                                  strict=True)]
        return self._background.run(_gather(jobs))

    async def _score(self, code: str) -> float:
        result = await self._lean.run_code(code, timeout_s=self.timeout_s)
        return 1.0 if result.ok and not result.sorries else 0.0

    def close(self) -> None:
        self._background.close()


async def _gather(jobs: list[Coroutine[Any, Any, float]]) -> list[float]:
    """All at once; a completion whose kiln jobs failed for good (dead-lettered after the runtime's retries) scores
    0, and is logged: the batch is not lost for one."""
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for result in results:
        if isinstance(result, KilnError):
            log.warning("a completion scored 0: its kiln job failed: %s", result)
        elif isinstance(result, BaseException):
            raise result
    return [r if isinstance(r, float) else 0.0 for r in results]
