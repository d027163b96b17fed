"""The Lean verifiers: ``lean`` elaborates the statement once (``theorem … := by sorry``) and tries every completion as
a tactic script on that proof state, concurrently (a sample that mentions ``sorry``/``admit`` scores 0 without
running); ``lean_code`` runs the completion after the task's statement as one Lean ``run_code``."""

from __future__ import annotations

import asyncio
import re

from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.rl import RolloutTask
from kiln.streams.errors import ClientError, RequestFailed
from kiln.workers.lean.client import LeanClient
from kiln.workers.verifiers.contract import PerCompletion, Verdict, VerifierContext, checked
from kiln.workers.verifiers.errors import InvalidTask


class LeanCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    statement: str = Field(min_length=1, description="the proposition, as after `theorem name :`")
    header: list[str] = Field(default_factory=list)
    timeout_s: float = Field(30.0, gt=0, le=600)


_UNSOUND = re.compile(r"\b(sorry|admit)\b")


class LeanVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.lean = LeanClient(context.kiln)
        self.failures_as_verdicts = context.failures_as_verdicts

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(LeanCheck, task)
        root = await self.lean.run_code(f"theorem kiln_goal : {check.statement} := by sorry", header=check.header,
                                        timeout_s=check.timeout_s, key=request_id)
        if not root.ok or len(root.sorries) != 1:
            raise InvalidTask(f"task {task.task_id}: the statement does not elaborate to one goal: "
                                  f"{root.error or root.messages}")
        state = root.sorries[0].state

        async def attempt(proof: str) -> Verdict:
            if not proof.strip() or _UNSOUND.search(proof):
                return Verdict(reward=0.0, details={"error": "empty or unsound proof"})
            try:
                result = await self.lean.run_tactic(state, proof, timeout_s=check.timeout_s)
            except RequestFailed as e:
                if not self.failures_as_verdicts:
                    raise
                timed_out = "ReplTimeout" in e.reason
                return Verdict(reward=0.0, details={"error": e.reason[:500]},
                               failure="timeout" if timed_out else "sandbox_error")
            if result.completed:
                return Verdict(reward=1.0)
            return Verdict(reward=0.0, details={"error": result.error, "goals_left": len(result.goals)})

        return list(await asyncio.gather(*(attempt(c) for c in completions)))

    async def close(self) -> None:
        pass


class LeanCodeCheck(BaseModel):
    """The completion after ``statement`` (e.g. ``theorem t : p → p := by``) as one Lean ``run_code``; reward 1 when
    Lean accepts it without ``sorry``."""

    model_config = ConfigDict(extra="forbid")

    statement: str = ""
    timeout_s: float = Field(60.0, gt=0, le=600)


class LeanCodeVerifier(PerCompletion):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        check = checked(LeanCodeCheck, task)
        return list(await asyncio.gather(*(self._attempt(check, c) for c in completions)))

    async def _attempt(self, check: LeanCodeCheck, completion: str) -> Verdict:
        try:
            result = await self.lean.run_code(f"{check.statement} {completion}".strip(), timeout_s=check.timeout_s)
        except ClientError as e:
            return self.failed(e)
        if result.ok and not result.sorries:
            return Verdict(reward=1.0)
        return Verdict(reward=0.0, details={"error": (result.error or "")[:500], "sorries": len(result.sorries)})
