"""``program``: a completion's program run on the task's stdin, checked against its expected output — the
stdin/stdout check of code-RL datasets (verl's, SandboxFusion's)."""

from __future__ import annotations

import asyncio
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.exec import SessionLimits
from kiln.schemas.rl import RolloutTask
from kiln.streams.errors import ClientError
from kiln.workers.verifiers.contract import PerCompletion, Verdict, checked, measured


class ProgramCheck(BaseModel):
    """A completion's program — its fenced code block (```python …```), or its whole text — run on ``stdin`` in
    ``language``'s interpreter; reward 1 when it exits 0 and prints ``expected_output`` (trailing whitespace of each
    line ignored): the stdin/stdout check of code-RL datasets (verl's, SandboxFusion's). A program that runs past
    ``timeout_s``, exits nonzero, is killed (its limits: ``limits``) or floods its stdout scores a real 0
    (``policy_failure``); only a run the sandbox could not make is kiln's failure."""

    model_config = ConfigDict(extra="forbid")

    expected_output: str
    stdin: str = ""
    language: Literal["python", "bash", "nodejs"] = "python"
    image: str = Field("kiln/toolchain:latest", min_length=1)
    timeout_s: float = Field(10.0, gt=0, le=600)
    limits: SessionLimits | None = None


PROGRAM_RUNNERS = {"python": ("main.py", "python3 main.py"), "bash": ("main.sh", "bash main.sh"),
                   "nodejs": ("main.js", "node main.js")}
_CODE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


class ProgramVerifier(PerCompletion):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        check = checked(ProgramCheck, task)
        return list(await asyncio.gather(*(self._attempt(check, c) for c in completions)))

    async def _attempt(self, check: ProgramCheck, completion: str) -> Verdict:
        found = _CODE.search(completion)
        source, command = PROGRAM_RUNNERS[check.language]
        try:
            result = await self.exec.run_once(check.image, command, files={source: found.group(1) if found else
                                                                           completion},
                                              stdin=check.stdin, timeout_s=check.timeout_s, limits=check.limits)
        except ClientError as e:
            return self.failed(e)
        output = result.output
        if output is None:  # the supervisor ran no step: kiln's, never the program's
            return Verdict(reward=0.0, details={"error": "no output"}, failure="sandbox_error")
        own = measured(output)
        if own is not None:  # past its time, killed, crashed, flooded: measured outside it, a real 0
            return Verdict(reward=0.0, details={"exit": output.exit_code}, policy_failure=own)
        matches = _lines(output.stdout) == _lines(check.expected_output)
        return Verdict(reward=1.0 if matches else 0.0, details={"exit": 0})
