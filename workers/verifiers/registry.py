"""The verifiers a worker knows: the built-in ones and those installed through the ``kiln.verifiers`` entry point group,
each made on first use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import FailureKind
from kiln.streams.errors import RequestFailed, RoutineJobError
from kiln.workers.verifiers.contract import Verdict, Verifier, VerifierContext
from kiln.workers.verifiers.errors import InvalidTask, SandboxError, VerifyError
from kiln.workers.verifiers.exact import ExactMatch
from kiln.workers.verifiers.exec import ExecVerifier
from kiln.workers.verifiers.lean import LeanCodeVerifier, LeanVerifier
from kiln.workers.verifiers.programs import ProgramVerifier
from kiln.workers.verifiers.repository import SWEVerifier, TestsVerifier
from kiln.workers.verifiers.version import verifier_version

BUILT_IN: dict[str, Callable[[VerifierContext], Verifier]] = {
    "exact_match": lambda _ctx: ExactMatch(), "exec": ExecVerifier, "lean": LeanVerifier, "swe": SWEVerifier,
    "program": ProgramVerifier, "tests": TestsVerifier, "lean_code": LeanCodeVerifier}


class Verifiers:
    """The verifiers a rollout worker knows, made on first use."""

    def __init__(self, context: VerifierContext) -> None:
        self.context = context
        self.factories = dict(BUILT_IN)
        for point in entry_points(group="kiln.verifiers"):
            self.factories[point.name] = point.load()
        self._made: dict[str, Verifier] = {}

    def get(self, name: str) -> Verifier:
        if name not in self._made:
            if name not in self.factories:
                raise InvalidTask(f"no verifier {name!r} (known: {sorted(self.factories)})")
            self._made[name] = self.factories[name](self.context)
        return self._made[name]

    def version(self, task: RolloutTask) -> str:
        """The version of the verifier the task names on this task (``kiln.workers.verifiers.version``); empty when
        no verifier by that name is known."""
        try:
            return verifier_version(self.get(task.verifier), task)
        except InvalidTask:
            return ""

    async def judge(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        """The task's verifier's verdicts, one per completion; a failure of the whole batch as that failure (kiln's,
        no reward) on every completion: a ``VerifyError`` or ``SandboxError`` by its kind, a stage that failed the
        request for good as ``sandbox_error``, a plug-in's routine error or a wrong count as ``checker_error``. Not
        stamped. What the verify stage answers, and the TRL rewards compute in process."""
        def every(error: str, failure: FailureKind) -> list[Verdict]:
            return [Verdict(reward=0.0, details={"error": error}, failure=failure)] * len(completions)

        try:
            verdicts = await self.get(task.verifier).verify(task, completions, request_id)
        except (VerifyError, SandboxError) as e:
            return every(str(e), e.failure)
        except RequestFailed as e:  # a stage the verifier relies on failed the request for good
            return every(e.reason, "sandbox_error")
        except RoutineJobError as e:  # a verifier plugged in through kiln.verifiers, failing routinely
            return every(str(e), "checker_error")
        if len(verdicts) != len(completions):
            return every(f"verifier {task.verifier!r} gave {len(verdicts)} verdicts for {len(completions)}",
                         "checker_error")
        return verdicts

    def stamped(self, task: RolloutTask, verdicts: list[Verdict],
                answers: Sequence[dict[str, Any]] | None = None) -> list[Verdict]:
        """The verdicts naming the verifier that decided them and its version: the one place every verifier's
        verdicts (the verify stage's and the rollout stage's) get them. ``answers``: per verdict, what else its
        caller sets (the verify stage's reason, counts and time), in the same copy; the stamp is applied last."""
        stamp = {"verifier": task.verifier, "version": self.version(task)}
        if answers is None:
            return [v.model_copy(update=stamp) for v in verdicts]
        return [v.model_copy(update={**answer, **stamp}) for v, answer in zip(verdicts, answers, strict=True)]

    async def close(self) -> None:
        for verifier in self._made.values():
            await verifier.close()
        await self.context.kiln.close()
