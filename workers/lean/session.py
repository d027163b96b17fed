"""The Lean operations on a pooled process: run code, run a tactic; answer with state handles, export rarely.

A new proof state stays live in the process that made it and the reply carries a handle (``ProofStateRef``: base
+ tactic path) — no pickle on the reply path. A state is exported (REPL pickle, zstd, inline or a claim check in
the blob store) when its path reaches ``export_every`` tactics, or always for commands too large to re-run. A
process lacking a state re-derives it from the nearest ancestor it holds, else from the base (import the pickle or
re-run the command), replaying the rest of the path.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zstandard

from kiln.schemas.lean import (
    MAX_PATH,
    MAX_REPLAY_CODE_CHARS,
    LeanMessage,
    LeanRequest,
    LeanResult,
    ProofStateRef,
    Sorry,
    code_base,
)
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import PermanentJobError
from kiln.workers.lean.errors import ReplProtocolError
from kiln.workers.lean.pool import ReplPool
from kiln.workers.lean.repl import Header, ReplProcess

ZSTD_LEVEL = 3


@dataclass
class StateCodec:
    blobs: BlobStore | None
    inline_limit: int = 192 * 1024

    def encode(self, raw: bytes, header: Header, affinity: str, goals: list[str]) -> ProofStateRef:
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
        sid = hashlib.sha256(packed).hexdigest()
        body: dict[str, str] = {"data": base64.b64encode(packed).decode()}
        if len(packed) > self.inline_limit and self.blobs is not None:
            body = {"claim": self.blobs.put(packed).digest}
        return ProofStateRef(id=sid, base=sid, header=list(header), raw_bytes=len(raw), stored_bytes=len(packed),
                             affinity=affinity, goals=goals, **body)

    def decode(self, ref: ProofStateRef) -> bytes:
        if ref.data is not None:
            packed = base64.b64decode(ref.data, validate=True)
        elif self.blobs is not None and ref.claim is not None:
            packed = self.blobs.get(ref.claim)
        else:
            raise PermanentJobError("the state is a claim check but this worker has no blob store")
        if hashlib.sha256(packed).hexdigest() != ref.base_id:
            raise PermanentJobError(f"proof state {ref.base_id[:12]} does not match its id")
        return zstandard.ZstdDecompressor().decompress(packed, max_output_size=4 << 30)


def split_header(request: LeanRequest) -> tuple[Header, str]:
    """The request's header and the code without it: leading ``import`` lines of the code join the header."""
    header = [line.strip() for line in request.header]
    body = (request.code or "").split("\n")
    while body and (body[0].strip().startswith("import ") or not body[0].strip()):
        line = body.pop(0).strip()
        if line:
            header.append(line)
    return tuple(header), "\n".join(body)


def _messages(reply: dict[str, Any]) -> list[LeanMessage]:
    return [LeanMessage.model_validate(m) for m in reply.get("messages", []) if isinstance(m, dict)]


ReplTimer = Callable[[str, float], None]
"""Called with (operation, seconds) for every REPL round trip: code, tactic, export, import, replay, and the fence
that follows each (``repl.py``)."""


class LeanSession:
    """Runs requests on a pool; ``affinity`` is the request key, recorded in every state it produces."""

    def __init__(self, pool: ReplPool, codec: StateCodec, export_every: int = 16,
                 on_repl: ReplTimer = lambda _op, _s: None) -> None:
        if not 1 <= export_every <= MAX_PATH:
            raise ValueError(f"export_every must be within 1..{MAX_PATH}")
        self.pool = pool
        self.codec = codec
        self.export_every = export_every
        self.on_repl = on_repl

    async def run(self, request: LeanRequest, affinity: str) -> LeanResult:
        if request.op == "run_code":
            return await self._run_code(request, affinity)
        return await self._run_tactic(request, affinity)

    async def _send(self, proc: ReplProcess, op: str, command: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            return await proc.send(command, timeout_s)
        finally:
            self.on_repl(op, time.perf_counter() - started - proc.fence_s)
            if proc.fence_s:
                self.on_repl("fence", proc.fence_s)

    async def _export(self, proc: ReplProcess, number: int, affinity: str, goals: list[str],
                      timeout_s: float) -> ProofStateRef:
        path = proc.workdir / f"{uuid.uuid4().hex}.olean"
        reply = await self._send(proc, "export", {"pickleTo": str(path), "proofState": number}, timeout_s)
        if "message" in reply:
            raise ReplProtocolError(f"exporting proof state {number} failed: {reply['message']}")
        try:
            raw = await asyncio.to_thread(path.read_bytes)
        finally:
            await asyncio.to_thread(path.unlink, True)
        ref = await asyncio.to_thread(self.codec.encode, raw, proc.header, affinity, goals)
        proc.held[ref.id] = number
        return ref

    async def _import(self, proc: ReplProcess, ref: ProofStateRef, timeout_s: float) -> int:
        raw = await asyncio.to_thread(self.codec.decode, ref)
        path = proc.workdir / f"{uuid.uuid4().hex}.olean"
        await asyncio.to_thread(path.write_bytes, raw)
        try:
            request: dict[str, Any] = {"unpickleProofStateFrom": str(path)}
            if proc.header_env is not None:
                request["env"] = proc.header_env
            reply = await self._send(proc, "import", request, timeout_s)
        finally:
            await asyncio.to_thread(path.unlink, True)
        if "proofState" not in reply:
            raise PermanentJobError(f"importing proof state {ref.base_id[:12]} failed: {reply.get('message')}")
        return int(reply["proofState"])

    async def _rerun(self, proc: ReplProcess, ref: ProofStateRef, timeout_s: float) -> int:
        assert ref.code is not None
        command: dict[str, Any] = {"cmd": ref.code}
        if proc.header_env is not None:
            command["env"] = proc.header_env
        sorries = (await self._send(proc, "replay", command, timeout_s)).get("sorries", [])
        if len(sorries) <= ref.sorry:
            raise PermanentJobError(f"re-running the command of state {ref.id[:12]} gave {len(sorries)} sorries")
        return int(sorries[ref.sorry]["proofState"])

    async def _restore(self, proc: ReplProcess, ref: ProofStateRef, timeout_s: float) -> int:
        """The state's number in ``proc``, from the nearest ancestor it holds, else from the base."""
        ancestry = ref.ancestry()[::-1]  # base first
        start = max((i for i, sid in enumerate(ancestry) if sid in proc.held), default=-1)
        if start >= 0:
            number = proc.held[ancestry[start]]
        else:
            number = await (self._rerun if ref.code is not None else self._import)(proc, ref, timeout_s)
            proc.held[ancestry[0]] = number
            start = 0
        for i in range(start + 1, len(ancestry)):
            tactic = ref.path[i - 1]
            reply = await self._send(proc, "replay", {"tactic": tactic, "proofState": number}, timeout_s)
            if "proofState" not in reply:
                raise PermanentJobError(f"replaying {tactic!r} towards state {ref.id[:12]} failed: "
                                        f"{reply.get('message')}")
            number = int(reply["proofState"])
            proc.held[ancestry[i]] = number
        return number

    async def _run_code(self, request: LeanRequest, affinity: str) -> LeanResult:
        header, body = split_header(request)
        async with self.pool.lease(header) as (proc, reused):
            cmd: dict[str, Any] = {"cmd": body}
            if proc.header_env is not None:
                cmd["env"] = proc.header_env
            reply = await self._send(proc, "code", cmd, request.timeout_s)
            usage = proc.usage
            if "message" in reply and "env" not in reply:
                return LeanResult(op="run_code", ok=False, error=str(reply["message"]), header_reused=reused,
                                  usage=usage)
            rerunnable = self.export_every > 1 and len(body) <= MAX_REPLAY_CODE_CHARS
            sorries = []
            for index, s in enumerate(reply.get("sorries", [])):
                goal, number = str(s.get("goal", "")), int(s["proofState"])
                if rerunnable:
                    base = code_base(list(header), body, index)
                    ref = ProofStateRef(id=base, base=base, header=list(header), code=body, sorry=index,
                                        affinity=affinity, goals=[goal])
                    proc.held[ref.id] = number
                else:
                    ref = await self._export(proc, number, affinity, [goal], request.timeout_s)
                sorries.append(Sorry(goal=goal, state=ref, pos=s.get("pos"), end_pos=s.get("endPos")))
            messages = _messages(reply)
            ok = not any(m.severity == "error" for m in messages)
            return LeanResult(op="run_code", ok=ok, messages=messages, sorries=sorries, header_reused=reused,
                              usage=usage)

    async def _run_tactic(self, request: LeanRequest, affinity: str) -> LeanResult:
        assert request.state is not None and request.tactic is not None
        ref = request.state
        async with self.pool.lease(tuple(ref.header), ref.ancestry()) as (proc, reused):
            number = proc.held.get(ref.id)
            pinned = number is not None
            if number is None:
                number = await self._restore(proc, ref, request.timeout_s)
            reply = await self._send(proc, "tactic", {"tactic": request.tactic, "proofState": number},
                                     request.timeout_s)
            usage = proc.usage
            if "proofState" not in reply:
                return LeanResult(op="run_tactic", ok=False, error=str(reply.get("message", "no reply")),
                                  header_reused=reused, state_pinned=pinned, usage=usage)
            goals = [str(g) for g in reply.get("goals", [])]
            messages = _messages(reply)
            new = ref.then(request.tactic, goals, affinity)
            if len(new.path) >= self.export_every:
                new = await self._export(proc, int(reply["proofState"]), affinity, goals, request.timeout_s)
            else:
                proc.held[new.id] = int(reply["proofState"])
            return LeanResult(op="run_tactic", ok=not any(m.severity == "error" for m in messages),
                              messages=messages, state=new, goals=goals, proof_status=reply.get("proofStatus"),
                              header_reused=reused, state_pinned=pinned, usage=usage)
