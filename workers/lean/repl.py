"""One Lean REPL process behind an asyncio API: frame requests, time-limit them, bound memory, recycle.

The REPL answers one request at a time, has no timeout of its own and only grows, so this wrapper kills the
process group on a timeout, on a reply that is not JSON, or when the tree's RSS passes the bound (an RSS
watchdog: an address-space rlimit breaks Lean's runtime, which reserves large virtual regions), and the pool
replaces it. A process is started with its header (the ``import`` lines) run once; every later command runs in
that environment, so imports are paid once per process.

The protocol channel (the REPL's stdin and stdout) is shared with the code being checked: ``#eval`` runs inside the
REPL process. So no reply is taken on its own: after each one the wrapper sends a fence, ``#check`` of a name made
of a fresh random nonce, and accepts the reply only when the very next one is the fence's ("unknown identifier"
naming that nonce). A reply written by the checked code (a forged verdict) is followed by the REPL's own, which
then stands where the fence's should: the process is killed (``ReplOutOfStep``) before the forged reply is used,
and no later request of that process can read a reply meant for another. The nonce exists only after the reply
arrived, so code that ran before it cannot have learnt it; code still running in the process could read it from
stdin, which is why the sandbox (``sandbox.py``) leaves no way to create a process and no ``/proc`` to reopen the
pipes by. Native code loaded into the process is beyond what this can tell (README, threat model).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.schemas.lean import ReplUsage
from kiln.workers.lean.errors import (
    ReplCrashed,
    ReplError,
    ReplMemoryExceeded,
    ReplOutOfStep,
    ReplProtocolError,
    ReplTimeout,
)

Header = tuple[str, ...]
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ReplLimits:
    memory_bytes: int = 8 << 30
    header_timeout_s: float = 600.0
    recycle_after: int = 1000
    poll_s: float = 0.05
    fence_timeout_s: float = 60.0  # a ``#check`` of an unknown name: milliseconds in any environment


def _die_with_parent() -> None:
    """In the child: SIGKILL when the worker dies, so a hung REPL never outlives a killed worker."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tree(pid: int, read: Callable[[int], float]) -> float:
    """``read`` summed over ``pid`` and its descendants (``lake env repl`` runs Lean as a child); a process that is
    gone counts nothing."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += read(p)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


def _rss(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _cpu_s(pid: int) -> float:
    """User + system time of the process and of its children it has reaped."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / _TICK


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants."""
    return int(_tree(pid, _rss))


def tree_cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` and its descendants have spent."""
    return _tree(pid, _cpu_s)


class ReplProcess:
    def __init__(self, command: Sequence[str], header: Header, workdir: Path, limits: ReplLimits,
                 cwd: Path | None = None, env: dict[str, str] | None = None, *, pass_fds: Sequence[int] = (),
                 fence: bool = True) -> None:
        """``pass_fds`` are handed to the command (the sandbox's seccomp program) and closed here once it started;
        ``fence`` off only for tests that show what the fence stops."""
        self.command = list(command)
        self.pass_fds = tuple(pass_fds)
        self.fence = fence
        self.fence_env: int | None = None  # the environment fences run in (the header's, else an empty command's)
        self.fence_s = 0.0  # how long the last request's fence took (part of what ``send`` took)
        self.header = header
        self.workdir = workdir
        self.limits = limits
        self.cwd = cwd
        self.env = env
        self.header_env: int | None = None
        self.requests = 0
        self.held: dict[str, int] = {}  # proof-state id (sha256) -> proofState number live in this process
        self.last_used = time.monotonic()
        self.exit_reason: str | None = None
        self.id = str(uuid.uuid4())
        self.usage: ReplUsage | None = None  # what the last request's round trip spent (send)
        self._peak_rss = 0  # the highest tree RSS the running request's watchdog saw
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and self.exit_reason is None

    def _close_pass_fds(self) -> None:
        for fd in self.pass_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pass_fds = ()

    async def start(self) -> None:
        await asyncio.to_thread(self.workdir.mkdir, parents=True, exist_ok=True)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL, cwd=self.cwd, env=self.env, start_new_session=True,
                preexec_fn=_die_with_parent, pass_fds=self.pass_fds,
                limit=64 << 20,  # one reply line can be large (goals of a big proof state)
            )
        finally:
            self._close_pass_fds()
        if self.header or self.fence:
            # The header's environment; without a header, an empty command's (fences then cost no import).
            reply = await self._exchange({"cmd": "\n".join(self.header)}, self.limits.header_timeout_s)
            if "env" not in reply:
                await self.kill("header failed")
                raise ReplCrashed(f"loading the header {list(self.header)} failed: {reply.get('message')}")
            if self.header:
                self.header_env = int(reply["env"])
            self.fence_env = int(reply["env"])
            if self.fence:
                await self._fenced()
            self.requests = 0

    async def send(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request, one reply; raises a ReplError (and kills the process) on anything but a reply, or on a
        reply out of step with the fence."""
        self.requests += 1
        self.fence_s = 0.0
        pid = self.pid
        cpu, started, self._peak_rss = tree_cpu_s(pid) if pid else 0.0, time.perf_counter(), 0
        reply = await self._exchange(request, timeout_s)
        if pid:
            self.usage = ReplUsage(repl=self.id, seconds=time.perf_counter() - started,
                                   cpu_s=max(0.0, tree_cpu_s(pid) - cpu),
                                   peak_rss_bytes=max(self._peak_rss, tree_rss(pid)))
        if self.fence:
            started = time.perf_counter()
            try:
                await self._fenced()
            finally:
                self.fence_s = time.perf_counter() - started
        return reply

    async def _fenced(self) -> None:
        """Sends a fence; returns when the next reply is the fence's, kills the process otherwise."""
        name = f"kiln_fence_{secrets.token_hex(16)}"
        fence: dict[str, Any] = {"cmd": f"#check {name}"}
        if self.fence_env is not None:
            fence["env"] = self.fence_env
        reply = await self._exchange(fence, self.limits.fence_timeout_s, watch=False)
        expected = f"unknown identifier '{name}'"
        messages = reply.get("messages")
        if not (isinstance(messages, list) and
                any(isinstance(m, dict) and expected in str(m.get("data", "")) for m in messages)):
            await self.kill("protocol")
            raise ReplOutOfStep("the REPL's replies are out of step with the fence (a reply written by the code "
                                "being checked, or one gone missing); the reply was not used and the process was "
                                "killed")

    async def _exchange(self, request: dict[str, Any], timeout_s: float, watch: bool = True) -> dict[str, Any]:
        """Writes ``request`` and reads one reply; ``watch`` off for fences (no memory watchdog: a ``#check`` of an
        unknown name allocates nothing, and the next request's watchdog sees the process as it is)."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None or not self.alive:
            raise ReplCrashed("the REPL process is not running")
        self.last_used = time.monotonic()
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n\n")
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise await self._crashed() from None
        if not watch:
            try:
                return await asyncio.wait_for(self._read_reply(proc.stdout), timeout_s)
            except TimeoutError:
                await self.kill("timeout")
                raise ReplTimeout(f"REPL request ran past {timeout_s:g}s; the process was killed") from None
            except asyncio.CancelledError:
                await self.kill("cancelled")
                raise
        reply_task = asyncio.ensure_future(self._read_reply(proc.stdout))
        watchdog = asyncio.ensure_future(self._watch_memory(proc.pid))
        try:
            done, _ = await asyncio.wait({reply_task, watchdog}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # given up mid-request: the process's state is unknown, and it must stop
            reply_task.cancel()
            await self.kill("cancelled")
            raise
        finally:
            watchdog.cancel()
        if reply_task in done:
            return reply_task.result()  # re-raises protocol errors / crashes
        reply_task.cancel()
        if watchdog in done and not watchdog.cancelled() and watchdog.exception() is None:
            await self.kill("memory")
            raise ReplMemoryExceeded(f"REPL passed its memory bound of {self.limits.memory_bytes >> 20} MiB")
        await self.kill("timeout")
        raise ReplTimeout(f"REPL request ran past {timeout_s:g}s; the process was killed")

    async def _read_reply(self, stdout: asyncio.StreamReader) -> dict[str, Any]:
        lines: list[bytes] = []
        while True:
            try:
                line = await stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):
                await self.kill("protocol")
                raise ReplProtocolError("REPL reply line exceeds the reader limit") from None
            if not line:
                raise await self._crashed()
            if line.strip():
                lines.append(line)
            elif lines:
                break
        try:
            reply = json.loads(b"".join(lines))
            if not isinstance(reply, dict):
                raise ValueError("reply is not an object")
        except ValueError as e:
            await self.kill("protocol")
            raise ReplProtocolError(f"REPL wrote something that is not a reply ({e}): "
                                    f"{b''.join(lines)[:200]!r}") from None
        return reply

    async def _watch_memory(self, pid: int) -> None:
        """Returns when the process tree's RSS passes the bound; runs until cancelled otherwise."""
        while True:
            rss = await asyncio.to_thread(tree_rss, pid)
            self._peak_rss = max(self._peak_rss, rss)
            if rss > self.limits.memory_bytes:
                return
            await asyncio.sleep(self.limits.poll_s)

    async def _crashed(self) -> ReplError:
        code = await self._reap()
        self.exit_reason = self.exit_reason or "crash"
        return ReplCrashed(f"REPL process exited mid-request (status {code})")

    async def kill(self, reason: str) -> None:
        """Kill the whole process group (Lean may run under ``lake env``) and reap it."""
        self.exit_reason = self.exit_reason or reason
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        await self._reap()

    async def _reap(self) -> int | None:
        if self._proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self._proc.wait(), 10)
        return self._proc.returncode

    async def close(self) -> None:
        self._close_pass_fds()
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(Exception):
                self._proc.stdin.close()
        await self.kill(self.exit_reason or "closed")
