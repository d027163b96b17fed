"""The verifiers a worker knows: the built-in ones and those installed through the ``kiln.verifiers`` entry point group,
each made on first use."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from kiln.workers.verifiers.contract import Verifier, VerifierContext
from kiln.workers.verifiers.errors import InvalidTask
from kiln.workers.verifiers.exact import ExactMatch
from kiln.workers.verifiers.exec import ExecVerifier
from kiln.workers.verifiers.lean import LeanCodeVerifier, LeanVerifier
from kiln.workers.verifiers.programs import ProgramVerifier
from kiln.workers.verifiers.repository import SWEVerifier, TestsVerifier

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

    async def close(self) -> None:
        for verifier in self._made.values():
            await verifier.close()
        await self.context.kiln.close()
