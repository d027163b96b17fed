"""``exec``: one exec ``run_once`` call checks a whole group — the groups and the task's checker files land in
``/work/.kiln-check`` of a warm runner, the checker runs once (see ``ExecCheck``), nothing of it outlives the call.
Groups verified at the same time with the same checker share that call and that checker process (up to
``exec_batch_groups``; at most ``exec_calls`` calls in flight): a round trip, and a checker's start, cost far more than
checking a small group. How long a batch gathers adapts to how groups arrive (``ExecVerifier._gathered``): a lone
group goes at once; a flood (groups arriving together or just after one another, or while a call with their checker
is still running) waits while groups keep coming (each pause up to ``exec_batch_quiet_s``, at most
``exec_batch_window_s``), so a step's batch costs what its checks cost. Groups in one call could tamper with each
other; a checker that runs sample code sets ``isolate`` and gets a call for its group alone."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from kiln.schemas.rl import RolloutTask
from kiln.streams.errors import RequestFailed
from kiln.workers.exec.client import ExecClient
from kiln.workers.verifiers.contract import (
    FAILURES,
    POLICY_FAILURES,
    SENT_TOGETHER,
    Verdict,
    VerifierContext,
    checked,
)
from kiln.workers.verifiers.errors import CheckTimeout, InvalidTask, SandboxError, VerifyError


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
    isolate: bool = Field(False, description="a call for this group alone: for checkers that run sample code, "
                                             "which could tamper with other groups checked in the same call")


_CHECK_DIR = ".kiln-check"  # where a checker's files and groups land, beside the image's /work


class ExecVerifier:
    def __init__(self, context: VerifierContext) -> None:
        self.exec = ExecClient(context.kiln)
        self._calls = asyncio.Semaphore(context.exec_calls)
        self.batch_groups, self.batch_window_s = context.exec_batch_groups, context.exec_batch_window_s
        self.batch_quiet_s = min(context.exec_batch_quiet_s, context.exec_batch_window_s)
        self._batches: dict[_Key, _Batch] = {}  # the batch groups with each checker join now (not full yet)
        # When a group with each checker last joined a batch, oldest first; kept for a quiet gap (a flood's memory).
        self._joined: OrderedDict[_Key, float] = OrderedDict()
        self._calling: Counter[_Key] = Counter()  # calls with each checker in flight (a sustained flood)
        # Of requests sent together (``SENT_TOGETHER``), how many have joined a batch so far, newest last.
        self._arrived: OrderedDict[str, int] = OrderedDict()
        self._running: set[asyncio.Future[None]] = set()

    async def close(self) -> None:
        pass

    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(ExecCheck, task)
        group = {"task_id": task.task_id, "prompt": task.prompt, "answer": task.answer, "completions": completions}
        pending = _Pending(group, asyncio.get_running_loop().create_future())
        if check.isolate:
            async with self._calls:
                await self._run([pending], check)
            return await pending.done
        key = (check.image, check.command, check.timeout_s, json.dumps(check.files, sort_keys=True))
        now = time.monotonic()
        together = SENT_TOGETHER.get()
        batch = self._batches.get(key)
        if batch is None:
            # A flood: groups with this checker kept coming until just now, or its calls are still running (a
            # steady stream, each group sent as another is answered), or the request says others were sent with it,
            # so more are likely on their way.
            flood = key in self._calling or now - self._joined.get(key, -math.inf) < self.batch_quiet_s or (
                together is not None and together.requests > 1)
            batch = self._batches[key] = _Batch(opened=now, flood=flood)
            self._spawn(self._dispatch(key, batch, check))
        if together is not None:
            batch.awaited.add(together.id)
            self._arrive(together.id, together.requests)
        batch.groups.append(pending)
        batch.joined.set()
        self._joined[key] = now
        self._joined.move_to_end(key)
        while next(iter(self._joined.values())) < now - self.batch_quiet_s:
            self._joined.popitem(last=False)
        if len(batch.groups) >= self.batch_groups:
            del self._batches[key]  # full: the next group opens the next batch
        return await pending.done

    def _arrive(self, together: str, requests: int) -> None:
        arrived = self._arrived.pop(together, 0) + 1
        if arrived < requests:  # still expecting some (a request of them answered elsewhere is waited for no longer
            self._arrived[together] = arrived  # than the window)
            while len(self._arrived) > _TOGETHER_KEPT:
                self._arrived.popitem(last=False)

    def _expecting(self, batch: _Batch) -> bool:
        """Requests sent with some of the batch's are still on their way."""
        return any(t in self._arrived for t in batch.awaited)

    def _spawn(self, dispatch: Coroutine[Any, Any, None]) -> None:
        running = asyncio.ensure_future(dispatch)
        self._running.add(running)
        running.add_done_callback(self._running.discard)

    async def _dispatch(self, key: _Key, batch: _Batch, check: ExecCheck) -> None:
        """Sends the batch once it has gathered (``_gathered``) and a call may start: while every call is busy, it
        keeps taking groups until full (so batches grow with load instead of queueing as many small commands)."""
        await self._gathered(batch)
        async with self._calls:
            if self._batches.get(key) is batch:
                del self._batches[key]
            self._calling[key] += 1
            try:
                await self._run(batch.groups, check)
            finally:
                self._calling[key] -= 1
                if not self._calling[key]:
                    del self._calling[key]

    async def _gathered(self, batch: _Batch) -> None:
        """Returns when the batch should go: the window adapts to how groups arrive. After one turn of the event
        loop (the requests delivered with its first group join it), a lone group goes at once; in a flood (groups
        joined with this checker just before or in that turn, or a call with it still running) the batch waits
        while groups keep joining — until none has for ``batch_quiet_s``, it is full, or ``batch_window_s`` has
        passed since it opened. Requests sent together (``SENT_TOGETHER``) are waited for whatever the gaps between
        them, within the window, and once the last of them has joined the batch goes."""
        await asyncio.sleep(0)
        if (not batch.flood and len(batch.groups) == 1) or (batch.awaited and not self._expecting(batch)):
            return  # a lone group, or every request sent with its groups has joined (a step's request: at once)
        deadline = batch.opened + self.batch_window_s
        while len(batch.groups) < self.batch_groups and (left := deadline - time.monotonic()) > 0:
            batch.joined.clear()
            expecting = self._expecting(batch)
            try:
                await asyncio.wait_for(batch.joined.wait(), left if expecting else min(self.batch_quiet_s, left))
            except TimeoutError:
                return
            if expecting and not self._expecting(batch) and len(batch.groups) < self.batch_groups:
                return  # the last of them joined: nothing more is on its way

    async def _run(self, batch: list[_Pending], check: ExecCheck) -> None:
        """One ``run_once`` call, one checker process for the whole batch, in a sandbox nothing of it outlives."""
        files = {f"{_CHECK_DIR}/{name}": text for name, text in
                 {**check.files, "groups.jsonl": "".join(json.dumps(p.group) + "\n" for p in batch)}.items()}
        try:
            try:
                result = await self.exec.run_once(check.image, check.command, files=files, cwd=_CHECK_DIR,
                                                  timeout_s=check.timeout_s, max_output_bytes=4 << 20)
            except RequestFailed as e:
                raise SandboxError(f"exec run_once failed: {e.reason}") from None
            output = result.output
            assert output is not None
            if output.timed_out:
                raise CheckTimeout(f"checker ran past {check.timeout_s} s on {len(batch)} groups")
            if output.exit_code != 0:
                raise VerifyError(f"checker exited {output.exit_code} (timed out: {output.timed_out}) on "
                                      f"{len(batch)} groups: {output.stderr[-2000:]}")
            if output.stdout_truncated:
                raise VerifyError(f"checker output over 4 MB for {len(batch)} groups")
            lines = [line for line in output.stdout.splitlines() if line.strip()]
            if len(lines) != len(batch):
                raise VerifyError(f"checker printed {len(lines)} lines for {len(batch)} groups")
        except Exception as e:
            for p in batch:
                p.done.set_exception(e)
            return
        for p, line in zip(batch, lines, strict=True):
            try:
                p.done.set_result(parse_verdicts(line, len(p.group["completions"]), p.group["task_id"]))
            except VerifyError as e:
                p.done.set_exception(e)


@dataclass
class _Pending:
    group: dict[str, Any]
    done: asyncio.Future[list[Verdict]]


_Key = tuple[str, str, float, str]  # a checker: image, command, timeout, files
_TOGETHER_KEPT = 1024  # requests sent together still awaited, newest kept


@dataclass
class _Batch:
    opened: float  # time.monotonic() of its first group
    flood: bool  # groups with its checker were arriving when it opened
    groups: list[_Pending] = field(default_factory=list)
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # set as a group joins
    awaited: set[str] = field(default_factory=set)  # ids of the requests its groups were sent with


def parse_verdicts(line: str, expected: int, task_id: str) -> list[Verdict]:
    """A group's line: ``{"verdicts": [{"reward": r, ...}, ...]}`` or ``{"error": "why"}``; anything else is the
    checker's fault (routine error). A verdict may name the completion's own failure, ``"policy_failure"`` (one of
    ``POLICY_FAILURES``; ``"failure": "timeout"`` says the same: a completion the checker stopped), a real verdict of
    0; or the checker's, ``"failure"`` (one of ``FAILURES``): no reward."""
    try:
        item = json.loads(line)
        if "error" in item:
            raise InvalidTask(f"task {task_id}: the checker refused the group: {str(item['error'])[:1000]}")
        verdicts = [_verdict(v) for v in item["verdicts"]]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise VerifyError(f"task {task_id}: checker printed {line[:200]!r}: {type(e).__name__}: {e}") from None
    if len(verdicts) != expected:
        raise VerifyError(f"task {task_id}: checker gave {len(verdicts)} verdicts for {expected} completions")
    return verdicts


def _verdict(item: dict[str, Any]) -> Verdict:
    failure, own = item.get("failure"), item.get("policy_failure")
    if failure == "timeout":  # the checker stopped the completion's program: its failure, not the checker's
        failure, own = None, own or "timeout"
    if failure is not None and failure not in FAILURES:
        raise ValueError(f"failure {failure!r} is not one of {FAILURES}")
    if own is not None and own not in POLICY_FAILURES:
        raise ValueError(f"policy_failure {own!r} is not one of {POLICY_FAILURES}")
    detail = {k: x for k, x in item.items() if k not in ("reward", "failure", "policy_failure")}
    return Verdict(reward=0.0 if failure or own else float(item["reward"]), details=detail, failure=failure,
                   policy_failure=own)
