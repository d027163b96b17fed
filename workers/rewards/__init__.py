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

from kiln.schemas.exec import RunStep, SessionLimits
from kiln.streams.client import KilnClient
from kiln.streams.errors import KilnError
from kiln.streams.settings import KilnSettings, get_settings
from kiln.workers.common.patches import APPLY_EXCLUDES, patch_text, protected_paths
from kiln.workers.exec.client import ExecClient
from kiln.workers.lean.client import LeanClient

T = TypeVar("T")
log = logging.getLogger("kiln.rewards")


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
    </patch>``, a ```diff fence, or the whole text), each completion in one exec ``run_once`` call on ``image`` (a
    builder-built image of the revision; a dataset column ``image`` overrides it per row). A patch that does not
    apply, touches the tests or their configuration (``kiln.workers.common.patches``), or a run without tests,
    scores 0; a report that shows no failure from a run whose exit status (measured outside the sandbox) failed
    counts an error."""

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
        patch = patch_text(text, whole=True) or ""
        if protected_paths(patch):
            return 0.0
        apply = RunStep(name="patch", command=f"git apply --whitespace=nowarn {APPLY_EXCLUDES} .kiln-task/patch.diff")
        result = await self._exec.run_once(image, steps=[apply], files={".kiln-task/patch.diff": patch}, tests=True,
                                           limits=self.limits, timeout_s=self.timeout_s)
        report = result.tests
        total = report.passed + report.failed + report.errors if report else 0
        return report.passed / total if report and total else 0.0

    def close(self) -> None:
        self._background.close()


class OutputMatches:
    """Reward = 1 when the completion's program, run on the row's ``stdin``, prints the row's ``expected_output``
    (trailing whitespace of each line ignored) — the check code-RL datasets use (verl's and SandboxFusion's
    stdin/stdout cases). The program is the completion's fenced code block (```python …```) or its whole text,
    run with ``language``'s command in one exec ``run_once`` call on ``image`` (kiln's toolchain image by default);
    its exit status and output are measured outside the sandbox."""

    __name__ = "kiln_output_matches"

    def __init__(self, language: str = "python", *, image: str = "kiln/toolchain:latest",
                 settings: KilnSettings | None = None, timeout_s: float = 10.0,
                 limits: SessionLimits | None = None) -> None:
        if language not in RUNNERS:
            raise ValueError(f"language {language!r}: one of {', '.join(sorted(RUNNERS))}")
        self.language, self.image, self.timeout_s, self.limits = language, image, timeout_s, limits
        self._background = _Background(settings)
        self._exec = ExecClient(self._background.kiln)

    def __call__(self, completions: list[Any], **columns: Any) -> list[float]:
        stdins = columns.get("stdin") or [""] * len(completions)
        expected = columns.get("expected_output")
        if expected is None:
            raise ValueError("OutputMatches needs an 'expected_output' column")
        jobs = [self._score(completion_text(c), str(i), str(e)) for c, i, e in zip(completions, stdins, expected,
                                                                                    strict=True)]
        return self._background.run(_gather(jobs))

    async def _score(self, text: str, stdin: str, expected: str) -> float:
        found = _CODE.search(text)
        source, command = RUNNERS[self.language]
        result = await self._exec.run_once(self.image, command, files={source: found.group(1) if found else text},
                                           stdin=stdin, timeout_s=self.timeout_s, limits=self.limits)
        output = result.output
        if output is None or output.exit_code != 0 or output.timed_out:
            return 0.0
        return 1.0 if _lines(output.stdout) == _lines(expected) else 0.0

    def close(self) -> None:
        self._background.close()


RUNNERS = {"python": ("main.py", "python3 main.py"), "bash": ("main.sh", "bash main.sh"),
           "nodejs": ("main.js", "node main.js")}
_CODE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


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


class Verified:
    """Reward = the ``verify`` stage's verdict, from the verifiers the rollout stage uses (``exec`` checkers,
    ``swe`` repository tasks, ``lean``, ``exact_match``, ``kiln.verifiers`` entry points): the row's ``kiln_task``
    column (a task's dict or JSON: ``verifier``, ``check``, ``answer``), else its ``answer`` column. The batch goes
    out at once, one verify request per distinct task (a prompt's completions share a sandbox where the verifier
    allows). A completion without a real verdict (timeout, sandbox error, …) scores 0 and is logged."""

    __name__ = "kiln_verified"

    def __init__(self, *, settings: KilnSettings | None = None) -> None:
        from kiln.workers.verify.client import BlockingVerifyClient

        self._client = BlockingVerifyClient(settings, f"rewards.{socket.gethostname()}.{os.getpid()}")

    def __call__(self, completions: list[Any], prompts: list[Any] | None = None, **columns: Any) -> list[float]:
        from kiln.workers.trainers import task_of

        labels = columns.get("kiln_task") or columns.get("answer")
        if labels is None:
            raise ValueError("Verified needs a 'kiln_task' (or 'answer') column")
        texts = [completion_text(p) if p is not None else "" for p in (prompts or [None] * len(completions))]
        tasks = [task_of(label, text) for label, text in zip(labels, texts, strict=True)]
        verdicts = self._client.verify_batch(tasks, [completion_text(c) for c in completions])
        return [v.reward for v in verdicts]

    def close(self) -> None:
        self._client.close()
