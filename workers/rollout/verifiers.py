"""Verifiers: a reward for every sample of a prompt group, computed by kiln's own stages through their client facades.

- ``exact_match``: in process, the number a completion starts with equals the task's answer.
- ``exec``: one exec command checks the whole group inside a sandboxed session — it unpacks the group (prompt,
  answer, completions) and the task's checker files into a fresh directory, runs the checker, which prints one JSON
  verdict per completion, and removes the directory. Sessions are pooled per image and recycled after
  ``exec_session_groups`` groups: a session costs a container, and each group still runs in its own directory.
- ``lean``: the statement is elaborated once (``theorem … := by sorry``), every completion is tried as a tactic script
  on that proof state, concurrently; a sample that mentions ``sorry``/``admit`` scores 0 without running.

A user plugs in their own through the ``kiln.verifiers`` entry point group: ``name = "module:factory"``, the factory
takes a ``VerifierContext`` and returns a ``Verifier``. ``RolloutTask.check`` carries what the verifier needs; each
validates it with its own model, and a task it cannot read fails as a routine error (dead-lettered with the reason).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Annotated, Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from kiln.schemas.exec import SessionLimits
from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed, RoutineJobError, TransientJobError
from kiln.workers.exec.client import ExecClient, ExecSession
from kiln.workers.lean.client import LeanClient
from kiln.workers.rollout.tasks import exact_match


@dataclass
class Verdict:
    reward: float
    detail: dict[str, Any] = field(default_factory=dict)


class Verifier(Protocol):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]: ...

    async def close(self) -> None: ...


@dataclass
class VerifierContext:
    """What a verifier may use: the worker's client of the other stages."""

    kiln: KilnClient
    exec_session_groups: int = 16
    exec_sessions: int = 4


_M = TypeVar("_M", bound=BaseModel)


def checked(model: type[_M], task: RolloutTask) -> _M:
    try:
        return model.model_validate(task.check)
    except ValidationError as e:
        raise RoutineJobError(f"task {task.task_id}: check for {task.verifier!r} is invalid: {e}") from None


class ExactMatch:
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        del request_id
        return [Verdict(exact_match(task, c)) for c in completions]

    async def close(self) -> None:
        pass


class ExecCheck(BaseModel):
    """``command`` runs in the group's directory, which holds ``group.json`` (``task_id``, ``prompt``, ``answer``,
    ``completions``) and ``files``; it prints one JSON object per completion, in order, each with a ``reward``."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    command: str = Field(min_length=1)
    files: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")], str] = Field(
        default_factory=dict, description="checker files by plain name")
    timeout_s: float = Field(60.0, gt=0, le=600)


_INLINE_LIMIT = 64_000  # the exec stage takes commands up to 100 kB


class ExecVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.exec = ExecClient(context.kiln)
        self.recycle_after, self.most = context.exec_session_groups, context.exec_sessions
        self._idle: dict[str, list[tuple[ExecSession, int]]] = {}
        self._open: dict[str, int] = {}
        self._freed = asyncio.Condition()

    async def _take(self, image: str) -> tuple[ExecSession, int]:
        async with self._freed:
            while not self._idle.get(image) and self._open.get(image, 0) >= self.most:
                await self._freed.wait()
            if self._idle.get(image):
                return self._idle[image].pop()
            self._open[image] = self._open.get(image, 0) + 1
        try:
            return await self.exec.open_session(image, limits=SessionLimits()), 0
        except BaseException:
            await self._drop(image, None)
            raise

    async def _give(self, image: str, session: ExecSession, used: int) -> None:
        if used >= self.recycle_after:
            await self._drop(image, session)
            return
        async with self._freed:
            self._idle.setdefault(image, []).append((session, used))
            self._freed.notify()

    async def _drop(self, image: str, session: ExecSession | None) -> None:
        async with self._freed:
            self._open[image] -= 1
            self._freed.notify()
        if session is not None:
            # A session that is gone already (its worker died) is reaped by the exec stage.
            with contextlib.suppress(RequestFailed):
                await self.exec.close_session(session)

    async def close(self) -> None:
        idle, self._idle = self._idle, {}
        for image, sessions in idle.items():
            for session, _used in sessions:
                await self._drop(image, session)

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(ExecCheck, task)
        directory = shlex.quote(f".kiln-rollout/{request_id}")
        group = {"task_id": task.task_id, "prompt": task.prompt, "answer": task.answer, "completions": completions}
        files = {**check.files, "group.json": json.dumps(group)}
        # One command per group (files travel inside it, base64): a round trip to the session costs more than the
        # check itself for small tasks. Groups too large for a command line are written first.
        unpack = " && ".join(f"printf %s {base64.b64encode(text.encode()).decode()} | base64 -d > {shlex.quote(name)}"
                             for name, text in files.items())
        inline = len(unpack) < _INLINE_LIMIT
        command = (f"mkdir -p {directory} && cd {directory} && {unpack if inline else 'true'} && "
                   f"{{ {check.command} ; }}; status=$?; cd /work && rm -rf {directory}; exit $status")
        session, used = await self._take(check.image)
        try:
            if not inline:
                await self.exec.write_files(session, {f".kiln-rollout/{request_id}/{name}": text
                                                      for name, text in files.items()})
            output = await self.exec.run(session, command, timeout_s=check.timeout_s)
        except RequestFailed as e:
            await self._drop(check.image, session)
            raise TransientJobError(f"exec session {session.session_id} failed: {e.reason}") from None
        except BaseException:
            await self._drop(check.image, session)
            raise
        await self._give(check.image, session, used + 1)
        if output.exit_code != 0:
            raise RoutineJobError(f"task {task.task_id}: checker exited {output.exit_code} "
                                  f"(timed out: {output.timed_out}): {output.stderr[-2000:]}")
        return parse_verdicts(output.stdout, len(completions), task.task_id)


def parse_verdicts(stdout: str, expected: int, task_id: str) -> list[Verdict]:
    """One JSON object per line with a numeric ``reward``; anything else is the checker's fault (routine error)."""
    verdicts = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            reward = float(item["reward"])
        except (ValueError, TypeError, KeyError) as e:
            raise RoutineJobError(f"task {task_id}: checker printed {line[:200]!r}: {e}") from None
        verdicts.append(Verdict(reward, {k: v for k, v in item.items() if k != "reward"}))
    if len(verdicts) != expected:
        raise RoutineJobError(f"task {task_id}: checker gave {len(verdicts)} verdicts for {expected} completions")
    return verdicts


class LeanCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    statement: str = Field(min_length=1, description="the proposition, as after `theorem name :`")
    header: list[str] = Field(default_factory=list)
    timeout_s: float = Field(30.0, gt=0, le=600)


_UNSOUND = re.compile(r"\b(sorry|admit)\b")


class LeanVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.lean = LeanClient(context.kiln)

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(LeanCheck, task)
        root = await self.lean.run_code(f"theorem kiln_goal : {check.statement} := by sorry", header=check.header,
                                        timeout_s=check.timeout_s, key=request_id)
        if not root.ok or len(root.sorries) != 1:
            raise RoutineJobError(f"task {task.task_id}: the statement does not elaborate to one goal: "
                                  f"{root.error or root.messages}")
        state = root.sorries[0].state

        async def attempt(proof: str) -> Verdict:
            if not proof.strip() or _UNSOUND.search(proof):
                return Verdict(0.0, {"error": "empty or unsound proof"})
            result = await self.lean.run_tactic(state, proof, timeout_s=check.timeout_s)
            return Verdict(1.0 if result.completed else 0.0,
                           {"error": result.error, "goals_left": len(result.goals)} if not result.completed else {})

        return list(await asyncio.gather(*(attempt(c) for c in completions)))

    async def close(self) -> None:
        pass


BUILT_IN: dict[str, Callable[[VerifierContext], Verifier]] = {
    "exact_match": lambda _ctx: ExactMatch(), "exec": ExecVerifier, "lean": LeanVerifier}


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
                raise RoutineJobError(f"no verifier {name!r} (known: {sorted(self.factories)})")
            self._made[name] = self.factories[name](self.context)
        return self._made[name]

    async def close(self) -> None:
        for verifier in self._made.values():
            await verifier.close()
        await self.context.kiln.close()

