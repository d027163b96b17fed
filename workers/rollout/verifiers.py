"""Verifiers: a reward for every sample of a prompt group, computed by kiln's own stages through their client facades.

- ``exact_match``: in process, the number a completion starts with equals the task's answer.
- ``exec``: one exec command checks a whole group inside a sandboxed session — it unpacks the groups and the
  task's checker files into a fresh directory, runs the checker once (see ``ExecCheck``) and removes the directory.
  Groups verified at the same time with the same checker share that command and that checker process (up to
  ``exec_batch_groups``, gathered for ``exec_batch_window_s``): a round trip to a session, and a checker's start,
  cost far more than checking a small group. Sessions are pooled per image and recycled after ``exec_session_groups``
  commands. Groups sharing a session could tamper with each other; a checker that runs sample code sets
  ``isolate`` and gets a fresh session for its group alone.
- ``lean``: the statement is elaborated once (``theorem … := by sorry``), every completion is tried as a tactic script
  on that proof state, concurrently; a sample that mentions ``sorry``/``admit`` scores 0 without running.

- ``swe``: a repository task (``SWECheck``): each completion's patch and the task's test patch applied to a copy of
  the repository's built tree, its tests as the reward — one command for the group, in a session of its own.

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
import uuid
from collections.abc import Callable, Coroutine
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
    exec_batch_groups: int = 32
    exec_batch_window_s: float = 0.02


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
    """``command`` runs in a fresh directory holding ``files`` and ``groups.jsonl``: one group per line (``task_id``,
    ``prompt``, ``answer``, ``completions``). It prints one JSON line per group, in order:
    ``{"verdicts": [{"reward": r, ...}, ...]}`` (one per completion; other keys become the sample's verifier
    details) or ``{"error": "why"}`` (that group fails, the others stand)."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    command: str = Field(min_length=1)
    files: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")], str] = Field(
        default_factory=dict, description="checker files by plain name")
    timeout_s: float = Field(60.0, gt=0, le=600)
    isolate: bool = Field(False, description="a fresh session for this group alone: for checkers that run sample "
                                             "code, which could tamper with other groups sharing a session")


_INLINE_LIMIT = 64_000  # the exec stage takes commands up to 100 kB


class ExecVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.exec = ExecClient(context.kiln)
        self.recycle_after, self.most = context.exec_session_groups, context.exec_sessions
        self._idle: dict[str, list[tuple[ExecSession, int]]] = {}
        self._open: dict[str, int] = {}
        self._freed = asyncio.Condition()
        self.batch_groups, self.batch_window_s = context.exec_batch_groups, context.exec_batch_window_s
        self._batches: dict[tuple[str, str, float, str], list[_Pending]] = {}
        self._running: set[asyncio.Future[None]] = set()

    async def _take(self, pool: str, image: str) -> tuple[ExecSession, int]:
        async with self._freed:
            while not self._idle.get(pool) and self._open.get(pool, 0) >= self.most:
                await self._freed.wait()
            if self._idle.get(pool):
                return self._idle[pool].pop()
            self._open[pool] = self._open.get(pool, 0) + 1
        try:
            return await self.exec.open_session(image, limits=SessionLimits()), 0
        except BaseException:
            await self._drop(pool, None)
            raise

    async def _give(self, pool: str, session: ExecSession, used: int) -> None:
        if used >= self.recycle_after:
            await self._drop(pool, session)
            return
        async with self._freed:
            self._idle.setdefault(pool, []).append((session, used))
            self._freed.notify()

    async def _drop(self, pool: str, session: ExecSession | None) -> None:
        async with self._freed:
            self._open[pool] -= 1
            self._freed.notify()
        if session is not None:
            # A session that is gone already (its worker died) is reaped by the exec stage.
            with contextlib.suppress(RequestFailed):
                await self.exec.close_session(session)

    async def close(self) -> None:
        idle, self._idle = self._idle, {}
        for pool, sessions in idle.items():
            for session, _used in sessions:
                await self._drop(pool, session)

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(ExecCheck, task)
        group = {"task_id": task.task_id, "prompt": task.prompt, "answer": task.answer, "completions": completions}
        pending = _Pending(group, asyncio.get_running_loop().create_future())
        if check.isolate:
            await self._run([pending], check)
            return await pending.done
        key = (check.image, check.command, check.timeout_s, json.dumps(check.files, sort_keys=True))
        batch = self._batches.setdefault(key, [])
        batch.append(pending)
        if len(batch) == 1:
            self._spawn(self._dispatch(key, check))
        return await pending.done

    def _spawn(self, dispatch: Coroutine[Any, Any, None]) -> None:
        running = asyncio.ensure_future(dispatch)
        self._running.add(running)
        running.add_done_callback(self._running.discard)

    async def _dispatch(self, key: tuple[str, str, float, str], check: ExecCheck) -> None:
        """Sends the groups gathered for ``key`` once a session is free: while every session is busy, groups keep
        joining the waiting batch (so batches grow with load instead of queueing as many small commands)."""
        await asyncio.sleep(self.batch_window_s)
        try:
            session = await self._take(check.image, check.image)
        except Exception as e:
            for p in self._batches.pop(key, []):
                p.done.set_exception(e)
            return
        waiting = self._batches.pop(key, [])
        batch, rest = waiting[:self.batch_groups], waiting[self.batch_groups:]
        for p in rest:  # beyond one command's share: they start the next batch
            self._batches.setdefault(key, []).append(p)
        if rest:
            self._spawn(self._dispatch(key, check))
        await self._run(batch, check, session)

    async def _run(self, batch: list[_Pending], check: ExecCheck,
                   taken: tuple[ExecSession, int] | None = None) -> None:
        """One command, one checker process for the whole batch, in a fresh directory removed afterwards."""
        directory = shlex.quote(f".kiln-rollout/{uuid.uuid4().hex}")
        files = {**check.files, "groups.jsonl": "".join(json.dumps(p.group) + "\n" for p in batch)}
        # Files travel inside the command (base64) unless too large for a command line: one round trip.
        unpack = " && ".join(f"printf %s {base64.b64encode(text.encode()).decode()} | base64 -d > {shlex.quote(name)}"
                             for name, text in files.items())
        inline = len(unpack) < _INLINE_LIMIT
        command = (f"mkdir -p {directory} && cd {directory} && {unpack if inline else 'true'} && "
                   f"{{ {check.command} ; }}; status=$?; cd /work && rm -rf {directory}; exit $status")
        # Isolated groups get sessions of their own pool, never given back for another group.
        pool = f"{check.image} (isolated)" if check.isolate else check.image
        try:
            session, used = taken or await self._take(pool, check.image)
            try:
                if not inline:
                    await self.exec.write_files(session, {f"{directory}/{name}": text for name, text in files.items()})
                output = await self.exec.run(session, command, timeout_s=check.timeout_s, max_output_bytes=4 << 20)
            except RequestFailed as e:
                await self._drop(pool, session)
                raise TransientJobError(f"exec session {session.session_id} failed: {e.reason}") from None
            except BaseException:
                await self._drop(pool, session)
                raise
            await self._give(pool, session, self.recycle_after if check.isolate else used + 1)
            if output.exit_code != 0:
                raise RoutineJobError(f"checker exited {output.exit_code} (timed out: {output.timed_out}) on "
                                      f"{len(batch)} groups: {output.stderr[-2000:]}")
            if output.stdout_truncated:
                raise RoutineJobError(f"checker output over 4 MB for {len(batch)} groups")
            lines = [line for line in output.stdout.splitlines() if line.strip()]
            if len(lines) != len(batch):
                raise RoutineJobError(f"checker printed {len(lines)} lines for {len(batch)} groups")
        except Exception as e:
            for p in batch:
                p.done.set_exception(e)
            return
        for p, line in zip(batch, lines, strict=True):
            try:
                p.done.set_result(parse_verdicts(line, len(p.group["completions"]), p.group["task_id"]))
            except RoutineJobError as e:
                p.done.set_exception(e)


@dataclass
class _Pending:
    group: dict[str, Any]
    done: asyncio.Future[list[Verdict]]


def parse_verdicts(line: str, expected: int, task_id: str) -> list[Verdict]:
    """A group's line: ``{"verdicts": [{"reward": r, ...}, ...]}`` or ``{"error": "why"}``; anything else is the
    checker's fault (routine error)."""
    try:
        item = json.loads(line)
        if "error" in item:
            raise RoutineJobError(f"task {task_id}: the checker refused the group: {str(item['error'])[:1000]}")
        verdicts = [Verdict(float(v["reward"]), {k: x for k, x in v.items() if k != "reward"})
                    for v in item["verdicts"]]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise RoutineJobError(f"task {task_id}: checker printed {line[:200]!r}: {type(e).__name__}: {e}") from None
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


class SWECheck(BaseModel):
    """A repository task: the completion's ``<patch>…</patch>`` is applied to a copy of the session's tree (the
    repository's built image), then ``test_patch`` (the tests that define done), then ``test_command`` decides."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    test_patch: str = ""
    test_command: str = "python -m pytest -q -p no:cacheprovider"
    timeout_s: float = Field(300.0, gt=0, le=600)


# Runs in the group's own session (isolated: candidate patches run arbitrary code in the tests).
SWE_CHECKER = """\
import json, re, shutil, subprocess
test_patch, command = open("test.patch").read(), open("test_command").read()
def attempt(i, completion):
    found = re.search(r"<patch>\\n?(.*?)</patch>", completion, re.DOTALL)
    if found is None:
        return {"reward": 0.0, "stage": "no patch"}
    tree = f"/tmp/kiln-swe-{i}"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree("/work", tree, symlinks=True, ignore=shutil.ignore_patterns(".kiln-rollout"))
    try:
        for stage, diff in (("patch", found.group(1)), ("test patch", test_patch)):
            if not diff.strip():
                continue
            with open(tree + ".diff", "w") as f:
                f.write(diff)
            done = subprocess.run(["git", "apply", "--whitespace=nowarn", tree + ".diff"], cwd=tree,
                                  capture_output=True, text=True)
            if done.returncode:
                return {"reward": 0.0, "stage": f"{stage} does not apply", "log": done.stderr[-500:]}
        run = subprocess.run(command, shell=True, cwd=tree, capture_output=True, text=True)
        return {"reward": 1.0 if run.returncode == 0 else 0.0, "stage": "tests", "exit": run.returncode,
                "log": (run.stdout + run.stderr)[-500:]}
    finally:
        shutil.rmtree(tree, ignore_errors=True)
for line in open("groups.jsonl"):
    group = json.loads(line)
    print(json.dumps({"verdicts": [attempt(i, c) for i, c in enumerate(group["completions"])]}))
"""


class SWEVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.exec = ExecVerifier(context)

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(SWECheck, task)
        files = {"swe_check.py": SWE_CHECKER, "test.patch": check.test_patch, "test_command": check.test_command}
        as_exec = ExecCheck(image=check.image, command="python3 -I swe_check.py", files=files,
                            timeout_s=check.timeout_s, isolate=True)
        return await self.exec.verify(task.model_copy(update={"check": as_exec.model_dump()}), completions,
                                      request_id)

    async def close(self) -> None:
        await self.exec.close()


BUILT_IN: dict[str, Callable[[VerifierContext], Verifier]] = {
    "exact_match": lambda _ctx: ExactMatch(), "exec": ExecVerifier, "lean": LeanVerifier, "swe": SWEVerifier}


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

