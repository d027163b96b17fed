"""The Lean stage's messages: run code, run a tactic; proof states are handles the client carries.

A ``ProofStateRef`` names a state by its *base* and the tactic *path* from it: the base is either an exported
state (a zstd-compressed REPL pickle, inline or as a claim check in the blob store) or a command whose n-th
``sorry`` it is. The worker that made the state keeps it live in a REPL process and answers without exporting it;
any other process re-derives it from the handle (import or re-run the base, replay the path), so the service stays
semantically stateless and a crash loses nothing a client holds. ``affinity`` is the key of the request that
produced the state; follow-ups sent with it reach the worker that still holds it (loose pinning) — a miss costs a
re-derivation, never correctness. Workers export a state every ``KILN_LEAN_EXPORT_EVERY`` tactics, which bounds
the path (README, "Lean").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CODE_CHARS = 1_000_000
MAX_REPLAY_CODE_CHARS = 64_000
"""Commands up to this size can be a state's base (re-run on a miss); larger ones have their sorries exported."""
MAX_PATH = 256


def code_base(header: list[str], code: str, sorry: int) -> str:
    """The base id of the ``sorry``-th sorry of ``code`` run under ``header``."""
    return hashlib.sha256(json.dumps([header, code, sorry]).encode()).hexdigest()


def state_id(base: str, path: list[str]) -> str:
    """A state's id: its base, then one sha256 per tactic of the path (equal ids, equal states)."""
    for tactic in path:
        base = hashlib.sha256(json.dumps([base, tactic]).encode()).hexdigest()
    return base


class ProofStateRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[0-9a-f]{64}$", description="state_id(base, path)")
    header: list[str] = Field(description="The import lines the state needs loaded.")
    base: str = Field("", pattern=r"^([0-9a-f]{64})?$", description="sha256 of the exported pickle (data or "
                      "claim) or code_base(header, code, sorry); empty in the older form, where it is the id")
    data: str | None = Field(None, description="base64 of the zstd-compressed pickle, when small enough")
    claim: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$", description="blob digest otherwise")
    code: str | None = Field(None, max_length=MAX_REPLAY_CODE_CHARS, description="or the command (header "
                             "excluded) whose sorry number ``sorry`` is the base")
    sorry: int = Field(0, ge=0)
    path: list[str] = Field(default_factory=list, max_length=MAX_PATH, description="Tactics from the base.")
    raw_bytes: int = Field(0, ge=0, description="of the exported base pickle")
    stored_bytes: int = Field(0, ge=0)
    affinity: str = Field("", max_length=200)
    goals: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> ProofStateRef:
        if sum(x is not None for x in (self.data, self.claim, self.code)) != 1:
            raise ValueError("a state's base is exactly one of: inline data, a claim check, a command")
        base = self.base or self.id
        if self.code is not None and base != code_base(self.header, self.code, self.sorry):
            raise ValueError("base does not match the command it names")
        if state_id(base, self.path) != self.id:
            raise ValueError("id does not match the base and path")
        return self

    @property
    def base_id(self) -> str:
        return self.base or self.id

    @property
    def exported(self) -> bool:
        """The state itself is a pickle in the handle (nothing to re-derive)."""
        return self.code is None and not self.path

    def ancestry(self) -> list[str]:
        """Ids from this state back to its base."""
        ids = [self.base_id]
        for tactic in self.path:
            ids.append(state_id(ids[-1], [tactic]))
        return ids[::-1]

    def then(self, tactic: str, goals: list[str], affinity: str) -> ProofStateRef:
        """The handle of the state ``tactic`` led to from this one."""
        return self.model_copy(update={"id": state_id(self.id, [tactic]), "base": self.base_id,
                                       "path": [*self.path, tactic], "goals": goals, "affinity": affinity})


class LeanMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    severity: str
    data: str
    pos: dict[str, Any] | None = None
    end_pos: dict[str, Any] | None = Field(None, alias="endPos")


class Sorry(BaseModel):
    goal: str
    state: ProofStateRef
    pos: dict[str, Any] | None = None
    end_pos: dict[str, Any] | None = None


class LeanRequest(BaseModel):
    """``run_code``: ``code`` (its leading ``import`` lines, or ``header``, pick the process);
    ``run_tactic``: ``tactic`` on ``state``."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["run_code", "run_tactic"]
    header: list[str] = Field(default_factory=list, max_length=256)
    code: str | None = Field(None, max_length=MAX_CODE_CHARS)
    state: ProofStateRef | None = None
    tactic: str | None = Field(None, max_length=100_000)
    timeout_s: float = Field(60.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _operands(self) -> LeanRequest:
        if self.op == "run_code" and self.code is None:
            raise ValueError("run_code needs code")
        if self.op == "run_tactic" and (self.state is None or self.tactic is None):
            raise ValueError("run_tactic needs state and tactic")
        for line in self.header:
            if not line.startswith("import ") or "\n" in line:
                raise ValueError(f"header lines are single 'import ...' lines, got {line!r}")
        return self


class ReplUsage(BaseModel):
    """What the request's REPL process spent on it, read from /proc by the worker (outside the process): the
    request's own round trip, not the fence that checks its reply."""

    model_config = ConfigDict(extra="forbid")

    repl: str = Field(description="The serving REPL process's id (a UUID; the same for every request it serves).")
    seconds: float = Field(ge=0, description="wall time of the round trip")
    cpu_s: float = Field(ge=0, description="CPU time (user + system) of the process tree during it")
    peak_rss_bytes: int = Field(ge=0, description="the tree's highest resident size seen during it (sampled as the "
                                                  "memory bound is watched, and once after the reply)")


class LeanResult(BaseModel):
    """A Lean-level outcome. Lean errors (bad tactic, unknown identifier) are results: ``ok`` is False and
    ``error``/``messages`` say why; only infrastructure failures (crash, timeout, memory) fail the job."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["run_code", "run_tactic"]
    ok: bool
    error: str | None = None
    messages: list[LeanMessage] = Field(default_factory=list)
    sorries: list[Sorry] = Field(default_factory=list)
    state: ProofStateRef | None = None
    goals: list[str] = Field(default_factory=list)
    proof_status: str | None = None
    header_reused: bool = Field(False, description="served by a process that had the header loaded already")
    state_pinned: bool = Field(False, description="the input state was still live in the serving process")
    usage: ReplUsage | None = Field(None, description="the request's REPL round trip (kimina's debug diagnostics)")

    @property
    def completed(self) -> bool:
        return self.proof_status == "Completed"
