"""The verifiers a worker knows: the built-in ones and those installed through the ``kiln.verifiers`` entry point group,
each made on first use."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from kiln.schemas.rl import RolloutTask
from kiln.workers.verifiers.contract import Verdict, Verifier, VerifierContext
from kiln.workers.verifiers.errors import InvalidTask
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

    def stamped(self, task: RolloutTask, verdicts: list[Verdict]) -> list[Verdict]:
        """The verdicts naming the verifier that decided them and its version: the one place every verifier's
        verdicts (the verify stage's and the rollout stage's) get them."""
        stamp = {"verifier": task.verifier, "version": self.version(task)}
        return [v.model_copy(update=stamp) for v in verdicts]

    async def close(self) -> None:
        for verifier in self._made.values():
            await verifier.close()
        await self.context.kiln.close()
