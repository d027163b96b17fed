"""The errors of ``kiln.integrations.trainers``, under kiln's root ``KilnError``."""

from __future__ import annotations

from kiln.schemas.verify import CompletionVerdict
from kiln.streams.errors import KilnError


class NoReward(KilnError):
    """kiln could not judge the completion (its sandbox, checker, worker or a stage failed it; retried first): raised
    where the trainer's own "no reward" is an exception, so the completion is never scored 0. ``verdict`` says why."""

    def __init__(self, verdict: CompletionVerdict) -> None:
        super().__init__(f"no reward: kiln could not judge the completion ({verdict.failure}, {verdict.attempts} "
                         f"checks): {verdict.reason[:500]}")
        self.verdict = verdict

    def __reduce__(self) -> tuple[type[NoReward], tuple[CompletionVerdict]]:
        return type(self), (self.verdict,)  # raised in AReaL's reward process pool, re-raised in the trainer
