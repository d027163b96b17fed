"""Reward functions for TRL's ``GRPOTrainer`` (anything that calls ``f(completions, **columns) -> list[float | None]``),
computed by kiln's verifiers (``kiln.workers.verifiers``: the same code the rollout and ``verify`` stages run — one
implementation): every completion of a batch is one set of kiln jobs, all in flight at once, so a batch of 512 runs in
parallel across the exec or Lean workers. A reward object owns one ``BlockingVerifyClient`` (a ``KilnClient`` on a
background event loop: TRL calls rewards synchronously, from its own thread). By default the verifier runs in this
process and sends its jobs to the exec/Lean stages; ``through_stage=True`` sends the batch to the ``verify`` stage
instead (reward work off the trainer's node). A completion that failed by itself (its program past its time,
crashed, wrong) scores 0; one kiln could not judge (sandbox, checker, worker, stage — retried first within the
``KILN_VERIFY_RETRY_*`` budget, either way) is ``None``: TRL's own "no reward" (trl 1.16, ``GRPOTrainer``: a
reward function's ``None`` becomes NaN, ``trainer/grpo_trainer.py:1629`` and ``:1647``; a completion for which
every reward function gave NaN is left out of its group's mean and std and gets advantage 0, ``:2759`` to ``:2765``
and ``:2810``, since TRL PR #5902). With several reward functions a completion is left out only when all of them give
``None``; another function's number for it still counts. TRL logs a reward function's floats under its name and
takes nothing else from it: the verifier version that scored a batch goes to the ``kiln.rewards`` log the first time
a process sees it (``note_versions``)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence
from typing import Any

from kiln.integrations.trainers import note_versions, task_of
from kiln.schemas.exec import SessionLimits
from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import CompletionVerdict, scored
from kiln.streams.settings import KilnSettings
from kiln.workers.verifiers import PROGRAM_RUNNERS, VerifierContext, Verifiers
from kiln.workers.verify.client import BlockingVerifyClient, VerifySettings, rechecked

RUNNERS = PROGRAM_RUNNERS


def completion_text(completion: Any) -> str:
    """TRL passes strings, or for conversational datasets a list of messages: the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is a string or a list of messages, not {type(completion).__name__}")


class _Scorer:
    """A reward object's verdicts, on its own ``BlockingVerifyClient`` (TRL calls rewards synchronously, from its own
    thread): through the ``verify`` stage, or from the verifiers run in this process on that client's loop."""

    def __init__(self, settings: KilnSettings | None, through_stage: bool = False) -> None:
        self.retry = VerifySettings()
        self.bridge = BlockingVerifyClient(settings, f"rewards.{socket.gethostname()}.{os.getpid()}", self.retry)
        self.through_stage = through_stage
        self.verifiers = Verifiers(VerifierContext(self.bridge.kiln, failures_as_verdicts=True))

    def score(self, tasks: Sequence[RolloutTask], completions: Sequence[str]) -> list[float | None]:
        """``completions[i]`` against ``tasks[i]``; completions of one task are one verifier call. None: no reward
        (kiln could not judge it)."""
        return self.bridge.run(self._score(tasks, completions))

    async def _score(self, tasks: Sequence[RolloutTask], completions: Sequence[str]) -> list[float | None]:
        if self.through_stage:
            stamped = await self.bridge.client.verify_batch(tasks, completions)
            note_versions(stamped)
            return [scored(v) for v in stamped]
        groups: dict[str, tuple[RolloutTask, list[int]]] = {}
        for i, task in enumerate(tasks):
            groups.setdefault(task.model_dump_json(), (task, []))[1].append(i)

        async def in_process(task: RolloutTask, texts: list[str]) -> list[CompletionVerdict]:
            """The verifier's verdicts, computed here as the verify stage computes them."""
            return self.verifiers.stamped(task, await self.verifiers.judge(task, texts, ""))

        async def group(task: RolloutTask, at: list[int]) -> list[float | None]:
            verdicts = await rechecked(in_process, task, [completions[i] for i in at], self.retry)
            note_versions(verdicts)
            return [scored(v) for v in verdicts]

        answers = await asyncio.gather(*(group(task, at) for task, at in groups.values()))
        rewards: list[float | None] = [None] * len(completions)
        for (_, at), scores in zip(groups.values(), answers, strict=True):
            for i, reward in zip(at, scores, strict=True):
                rewards[i] = reward
        return rewards

    def close(self) -> None:
        self.bridge.close()


def _task(verifier: str, check: dict[str, Any]) -> RolloutTask:
    return RolloutTask(task_id=verifier, prompt="", verifier=verifier, check=check)


class TestsPassRatio:
    """Reward = the share of the repository's tests that pass with the completion's patch applied (``<patch>…
    </patch>``, a ```diff fence, or the whole text), each completion in one exec ``run_once`` call on ``image`` (a
    builder-built image of the revision; a dataset column ``image`` overrides it per row): the ``tests`` verifier
    (``kiln.workers.verifiers.TestsVerifier``). A patch that does not apply, touches the tests or their
    configuration (``kiln.workers.common.patches``), or a run without tests, scores 0, as does a report kiln cannot
    trust: per-test results that disagree with the runner's own summary, or none failing from a run whose exit
    status (measured outside the sandbox) failed. A dataset column ``expected_tests`` (the image's test names, from
    its build event) makes only those count: a name the run lacks counts failed, one it adds counts nothing."""

    __name__ = "kiln_tests_pass_ratio"  # TRL logs rewards under their functions' names
    __test__ = False  # not a pytest class, despite the name

    def __init__(self, image: str | None = None, *, settings: KilnSettings | None = None,
                 timeout_s: float = 600.0, limits: SessionLimits | None = None, through_stage: bool = False) -> None:
        self.image, self.timeout_s, self.limits = image, timeout_s, limits or SessionLimits()
        self._scorer = _Scorer(settings, through_stage)

    def __call__(self, completions: list[Any], **columns: Any) -> list[float | None]:
        images = columns.get("image") or [self.image] * len(completions)
        if any(image is None for image in images):
            raise ValueError("TestsPassRatio needs an image: pass one, or give the dataset an 'image' column")
        expected = columns.get("expected_tests") or [[]] * len(completions)
        tasks = [_task("tests", {"image": str(image), "timeout_s": self.timeout_s, "limits": self.limits.model_dump(),
                                 "expected_tests": list(names)}) for image, names in zip(images, expected, strict=True)]
        return self._scorer.score(tasks, [completion_text(c) for c in completions])

    def close(self) -> None:
        self._scorer.close()


class OutputMatches:
    """Reward = 1 when the completion's program, run on the row's ``stdin``, prints the row's ``expected_output``
    (trailing whitespace of each line ignored) — the check code-RL datasets use (verl's and SandboxFusion's
    stdin/stdout cases): the ``program`` verifier (``kiln.workers.verifiers.ProgramVerifier``). The program is the
    completion's fenced code block (```python …```) or its whole text, run with ``language``'s command in one exec
    ``run_once`` call on ``image`` (kiln's toolchain image by default); its exit status and output are measured
    outside the sandbox."""

    __name__ = "kiln_output_matches"

    def __init__(self, language: str = "python", *, image: str = "kiln/toolchain:latest",
                 settings: KilnSettings | None = None, timeout_s: float = 10.0,
                 limits: SessionLimits | None = None, through_stage: bool = False) -> None:
        if language not in RUNNERS:
            raise ValueError(f"language {language!r}: one of {', '.join(sorted(RUNNERS))}")
        self.language, self.image, self.timeout_s, self.limits = language, image, timeout_s, limits
        self._scorer = _Scorer(settings, through_stage)

    def __call__(self, completions: list[Any], **columns: Any) -> list[float | None]:
        stdins = columns.get("stdin") or [""] * len(completions)
        expected = columns.get("expected_output")
        if expected is None:
            raise ValueError("OutputMatches needs an 'expected_output' column")
        limits = self.limits.model_dump() if self.limits else None
        tasks = [_task("program", {"language": self.language, "image": self.image, "stdin": str(i),
                                   "expected_output": str(e), "timeout_s": self.timeout_s, "limits": limits})
                 for i, e in zip(stdins, expected, strict=True)]
        return self._scorer.score(tasks, [completion_text(c) for c in completions])

    def close(self) -> None:
        self._scorer.close()


class LeanProofAccepted:
    """Reward = 1 when Lean's kernel accepts the completion as the proof of the row's ``statement`` column (a named
    theorem up to its ``:=``, e.g. ``theorem t : p → p := by``), without ``sorry`` and with only allowed axioms — the
    ``lean_code`` verifier (``kiln.workers.verifiers.LeanCodeVerifier``); a dataset needs that column."""

    __name__ = "kiln_lean_proof_accepted"

    def __init__(self, *, settings: KilnSettings | None = None, timeout_s: float = 60.0,
                 through_stage: bool = False) -> None:
        self.timeout_s = timeout_s
        self._scorer = _Scorer(settings, through_stage)

    def __call__(self, completions: list[Any], **columns: Any) -> list[float | None]:
        statements = columns.get("statement") or [""] * len(completions)
        tasks = [_task("lean_code", {"statement": str(s), "timeout_s": self.timeout_s}) for s in statements]
        return self._scorer.score(tasks, [completion_text(c) for c in completions])

    def close(self) -> None:
        self._scorer.close()


class Verified:
    """Reward = the ``verify`` stage's verdict, from the verifiers the rollout stage uses (``exec`` checkers,
    ``swe`` repository tasks, ``lean``, ``exact_match``, ``kiln.verifiers`` entry points): the row's ``kiln_task``
    column (a task's dict or JSON: ``verifier``, ``check``, ``answer``), else its ``answer`` column. The batch goes
    out at once, its groups (one per distinct task) in one verify request (a prompt's completions share a sandbox
    where the verifier allows; ``through_stage=False``: the verifier runs in this process instead). A completion kiln
    could not judge is ``None`` (no reward, logged); one that failed by itself scores 0."""

    __name__ = "kiln_verified"

    def __init__(self, *, settings: KilnSettings | None = None, through_stage: bool = True) -> None:
        self._scorer = _Scorer(settings, through_stage)

    def __call__(self, completions: list[Any], prompts: list[Any] | None = None,
                 **columns: Any) -> list[float | None]:
        labels = columns.get("kiln_task") or columns.get("answer")
        if labels is None:
            raise ValueError("Verified needs a 'kiln_task' (or 'answer') column")
        texts = [completion_text(p) if p is not None else "" for p in (prompts or [None] * len(completions))]
        tasks = [task_of(label, text) for label, text in zip(labels, texts, strict=True)]
        return self._scorer.score(tasks, [completion_text(c) for c in completions])

    def close(self) -> None:
        self._scorer.close()
