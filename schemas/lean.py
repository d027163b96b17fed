"""The Lean stage's messages: run code, run a tactic; proof states travel with the client, compressed.

A ``ProofStateRef`` is the whole state (a zstd-compressed REPL pickle, inline or as a claim check in the blob
store), so any worker can continue from it: the service is semantically stateless. ``affinity`` is the key of the
request that produced the state; follow-ups sent with it reach the worker that still holds the state in a live
process (loose pinning) — a miss costs an unpickle, never correctness.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CODE_CHARS = 1_000_000


class ProofStateRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the compressed pickle")
    header: list[str] = Field(description="The import lines the state needs loaded.")
    data: str | None = Field(None, description="base64 of the zstd-compressed pickle, when small enough")
    claim: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$", description="blob digest otherwise")
    raw_bytes: int = Field(ge=0)
    stored_bytes: int = Field(ge=0)
    affinity: str = Field("", max_length=200)
    goals: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_body(self) -> ProofStateRef:
        if (self.data is None) == (self.claim is None):
            raise ValueError("a state is either inline (data) or a claim check, exactly one")
        return self


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

    @property
    def completed(self) -> bool:
        return self.proof_status == "Completed"
