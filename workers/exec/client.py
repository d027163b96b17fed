"""Client facade of the ``exec`` stage: the session handle a trainer keeps, and how its requests are routed.

A session lives on the worker that opened it: every later request goes to that partition, keyed by the session id
(so they run in the order sent, even pipelined). ``open`` is keyed by repository so one worker serves a
repository's sessions; past ``sessions_per_key`` open sessions of one repository (from this client) new ones use
the next key ``repo#1``, ``repo#2``, …, which hash to other partitions: a hot repository spills over instead of
queueing behind one worker.
"""

from __future__ import annotations

import asyncio
import base64
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.schemas.envelope import ResultEnvelope, new_request_id
from kiln.schemas.exec import CommandOutput, ExecOp, ExecRequest, ExecResult, RunStep, SessionLimits, file_content
from kiln.streams.client import KilnClient
from kiln.workers.exec.auth import ClientKeyPair, prove

_UNSIGNED = "0" * 64  # a placeholder proof: the digest a proof covers leaves the proofs out


@dataclass(frozen=True)
class ExecSession:
    """A session handle: ``key`` (the session key, unsealed here) signs every request and never leaves the
    process."""

    session_id: str
    key: bytes = field(repr=False)
    partition: int
    image: str
    repository: str = ""


def signed(key: bytes, request_id: str, **fields: Any) -> ExecRequest:
    """``fields`` as a request carrying its proof under ``key`` for ``request_id``."""
    request = ExecRequest(auth=_UNSIGNED, **fields)
    return request.model_copy(update={"auth": prove(key, request_id, request)})


@dataclass
class SpillOver:
    sessions_per_key: int = 4
    open_by_repository: Counter[str] = field(default_factory=Counter)

    def key_for(self, repository: str) -> str:
        return f"{repository}#{self.open_by_repository[repository] // max(1, self.sessions_per_key)}"

    def opened(self, repository: str) -> None:
        self.open_by_repository[repository] += 1

    def closed(self, repository: str) -> None:
        if self.open_by_repository[repository] > 0:
            self.open_by_repository[repository] -= 1


class ExecClient:
    """Exec sessions over a shared ``KilnClient`` (the "task engine" layer: files, commands, tests, linters)."""

    def __init__(self, kiln: KilnClient, *, sessions_per_key: int = 4) -> None:
        self.kiln = kiln
        self._spill = SpillOver(sessions_per_key)
        self._keys = ClientKeyPair()  # session keys come back sealed to it

    async def open_session(self, image: str, *, repository: str = "", limits: SessionLimits | None = None,
                           snapshot: str | None = None, snapshot_of: ExecSession | None = None) -> ExecSession:
        """A fresh isolated session on ``image`` (a kiln build), or from ``snapshot`` (taken by ``snapshot_of``,
        whose key proves the right to it). The returned handle's key is the session's capability."""
        key = self._spill.key_for(repository or image)
        request_id = new_request_id()
        fields: dict[str, Any] = {"op": "open", "image": image, "repository": repository or None,
                                  "snapshot": snapshot, "limits": limits or SessionLimits(),
                                  "client_key": self._keys.public_b64}
        if snapshot is not None:
            if snapshot_of is None:
                raise ValueError("opening from a snapshot needs the session that took it (snapshot_of)")
            draft = ExecRequest(snapshot_session=snapshot_of.session_id, snapshot_auth=_UNSIGNED, **fields)
            request = draft.model_copy(update={"snapshot_auth": prove(snapshot_of.key, request_id, draft)})
        else:
            request = ExecRequest(**fields)
        result: ExecResult = await self.kiln.call("exec", request, key=key, request_id=request_id)
        self._spill.opened(repository or image)
        return self._session(result, image, repository or image)

    def _session(self, result: ExecResult, image: str, repository: str) -> ExecSession:
        assert result.sealed_key is not None and result.partition is not None
        return ExecSession(result.session_id, self._keys.unseal(result.sealed_key), result.partition, image,
                           repository)

    async def submit(self, session: ExecSession, op: ExecOp, **fields: Any) -> asyncio.Future[ResultEnvelope]:
        """Send one session request without waiting (pipelining): results of a session come back in order."""
        request_id = new_request_id()
        if op == "fork":
            fields.setdefault("client_key", self._keys.public_b64)
        request = signed(session.key, request_id, op=op, session_id=session.session_id, **fields)
        return await self.kiln.submit("exec", request, key=session.session_id, partition=session.partition,
                                      request_id=request_id)

    async def _exec(self, session: ExecSession, op: ExecOp, **fields: Any) -> ExecResult:
        result: ExecResult = self.kiln.result_of(await (await self.submit(session, op, **fields)))
        return result

    async def run(self, session: ExecSession, command: str, *, timeout_s: float = 60.0,
                  max_output_bytes: int = 64 * 1024) -> CommandOutput:
        result = await self._exec(session, "run", command=command, timeout_s=timeout_s,
                                  max_output_bytes=max_output_bytes)
        assert result.output is not None
        return result.output

    async def write_files(self, session: ExecSession, files: dict[str, str | bytes]) -> None:
        await self._exec(session, "write_files", files=[file_content(p, c) for p, c in files.items()])

    async def read_files(self, session: ExecSession, paths: list[str]) -> dict[str, bytes]:
        result = await self._exec(session, "read_files", paths=paths)
        return {f.path: f.text.encode() if f.text is not None else base64.b64decode(f.content_b64 or "")
                for f in result.files}

    async def apply_patch(self, session: ExecSession, patch: str, *, timeout_s: float = 60.0) -> CommandOutput:
        """``git apply`` of a unified diff in /work; a patch that does not apply is a nonzero exit, not an error."""
        result = await self._exec(session, "apply_patch", patch=patch, timeout_s=timeout_s)
        assert result.output is not None
        return result.output

    async def run_tests(self, session: ExecSession, *, timeout_s: float = 600.0) -> ExecResult:
        return await self._exec(session, "run_tests", timeout_s=timeout_s)

    async def lint(self, session: ExecSession, *, timeout_s: float = 300.0) -> ExecResult:
        return await self._exec(session, "lint", timeout_s=timeout_s)

    async def snapshot(self, session: ExecSession) -> str:
        result = await self._exec(session, "snapshot")
        assert result.snapshot is not None
        return result.snapshot

    async def fork(self, session: ExecSession) -> ExecSession:
        result = await self._exec(session, "fork")
        self._spill.opened(session.repository)
        return self._session(result, session.image, session.repository)

    async def run_once(self, image: str, command: str | None = None, *,
                       files: Mapping[str, str | bytes] | None = None,
                       steps: list[RunStep] | None = None, stdin: str | None = None,
                       limits: SessionLimits | None = None, timeout_s: float = 60.0,
                       max_output_bytes: int = 64 * 1024, fetch: list[str] | None = None,
                       env: dict[str, str] | None = None, cwd: str = "", tests: bool = False,
                       deadline_s: float | None = None) -> ExecResult:
        """``command`` (or ``steps``) on ``image`` with ``files`` in /work, in a sandbox of its own that nothing of
        it outlives: no session to open or close, a warm runner per call. ``fetch`` names files (relative to
        ``cwd``; a trailing ``/`` takes a directory's files) to return. Each step's result is measured outside the
        code it ran (``result.steps``; ``result.output`` is the last step's). ``tests``: then the image's test
        command, its reports parsed into ``result.tests`` (checked against its exit status). ``deadline_s``: the
        request's time budget (``KilnClient.submit``): not started by then, it is answered expired, never run."""
        if steps is None:
            steps = [RunStep(name="run", command=command, timeout_s=timeout_s, stdin=stdin)] if command else []
        elif command is not None or stdin is not None:
            raise ValueError("run_once takes a command (and stdin) or steps, not both")
        request = ExecRequest(op="run_once", image=image, steps=steps, limits=limits or SessionLimits(),
                              files=[file_content(p, c) for p, c in (files or {}).items()], paths=fetch or [],
                              env=env or {}, cwd=cwd, max_output_bytes=max_output_bytes, tests=tests,
                              timeout_s=max([timeout_s, *(s.timeout_s for s in steps)]))
        # Any worker can serve it: a fresh key spreads calls over every partition.
        result: ExecResult = await self.kiln.call("exec", request, key=new_request_id(), deadline_s=deadline_s)
        return result

    async def close_session(self, session: ExecSession) -> None:
        await self._exec(session, "close")
        self._spill.closed(session.repository)
