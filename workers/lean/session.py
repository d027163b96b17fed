"""The Lean operations on a pooled process: run code, run a tactic; export every new proof state and import the
ones a request brings (unless the serving process still holds them).

Exported states are REPL pickles compressed with zstd; small ones travel inside the result (base64), larger ones
as claim checks in the blob store, so the next step can run on any worker.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import zstandard

from kiln.schemas.lean import LeanMessage, LeanRequest, LeanResult, ProofStateRef, Sorry
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
        if len(packed) <= self.inline_limit or self.blobs is None:
            return ProofStateRef(id=sid, header=list(header), data=base64.b64encode(packed).decode(),
                                 raw_bytes=len(raw), stored_bytes=len(packed), affinity=affinity, goals=goals)
        claim = self.blobs.put(packed).digest
        return ProofStateRef(id=sid, header=list(header), claim=claim, raw_bytes=len(raw), stored_bytes=len(packed),
                             affinity=affinity, goals=goals)

    def decode(self, ref: ProofStateRef) -> bytes:
        if ref.data is not None:
            packed = base64.b64decode(ref.data, validate=True)
        elif self.blobs is not None and ref.claim is not None:
            packed = self.blobs.get(ref.claim)
        else:
            raise PermanentJobError("the state is a claim check but this worker has no blob store")
        if hashlib.sha256(packed).hexdigest() != ref.id:
            raise PermanentJobError(f"proof state {ref.id[:12]} does not match its id")
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


class LeanSession:
    """Runs requests on a pool; ``affinity`` is the request key, recorded in every state it produces."""

    def __init__(self, pool: ReplPool, codec: StateCodec) -> None:
        self.pool = pool
        self.codec = codec

    async def run(self, request: LeanRequest, affinity: str) -> LeanResult:
        if request.op == "run_code":
            return await self._run_code(request, affinity)
        return await self._run_tactic(request, affinity)

    async def _export(self, proc: ReplProcess, number: int, affinity: str, goals: list[str],
                      timeout_s: float) -> ProofStateRef:
        path = proc.workdir / f"{uuid.uuid4().hex}.olean"
        reply = await proc.send({"pickleTo": str(path), "proofState": number}, timeout_s)
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
            reply = await proc.send(request, timeout_s)
        finally:
            await asyncio.to_thread(path.unlink, True)
        if "proofState" not in reply:
            raise PermanentJobError(f"importing proof state {ref.id[:12]} failed: {reply.get('message')}")
        number = int(reply["proofState"])
        proc.held[ref.id] = number
        return number

    async def _run_code(self, request: LeanRequest, affinity: str) -> LeanResult:
        header, body = split_header(request)
        async with self.pool.lease(header) as (proc, reused):
            cmd: dict[str, Any] = {"cmd": body}
            if proc.header_env is not None:
                cmd["env"] = proc.header_env
            reply = await proc.send(cmd, request.timeout_s)
            if "message" in reply and "env" not in reply:
                return LeanResult(op="run_code", ok=False, error=str(reply["message"]), header_reused=reused)
            sorries = []
            for s in reply.get("sorries", []):
                goal = str(s.get("goal", ""))
                ref = await self._export(proc, int(s["proofState"]), affinity, [goal], request.timeout_s)
                sorries.append(Sorry(goal=goal, state=ref, pos=s.get("pos"), end_pos=s.get("endPos")))
            messages = _messages(reply)
            ok = not any(m.severity == "error" for m in messages)
            return LeanResult(op="run_code", ok=ok, messages=messages, sorries=sorries, header_reused=reused)

    async def _run_tactic(self, request: LeanRequest, affinity: str) -> LeanResult:
        assert request.state is not None and request.tactic is not None
        ref = request.state
        async with self.pool.lease(tuple(ref.header), ref.id) as (proc, reused):
            number = proc.held.get(ref.id)
            pinned = number is not None
            if number is None:
                number = await self._import(proc, ref, request.timeout_s)
            reply = await proc.send({"tactic": request.tactic, "proofState": number}, request.timeout_s)
            if "proofState" not in reply:
                return LeanResult(op="run_tactic", ok=False, error=str(reply.get("message", "no reply")),
                                  header_reused=reused, state_pinned=pinned)
            goals = [str(g) for g in reply.get("goals", [])]
            messages = _messages(reply)
            new = await self._export(proc, int(reply["proofState"]), affinity, goals, request.timeout_s)
            return LeanResult(op="run_tactic", ok=not any(m.severity == "error" for m in messages),
                              messages=messages, state=new, goals=goals, proof_status=reply.get("proofStatus"),
                              header_reused=reused, state_pinned=pinned)
