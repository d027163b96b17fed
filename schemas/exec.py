"""The exec stage's messages: sessions on built images, whose capability never travels on a topic.

``open`` (and ``fork``) carry the client's X25519 public key; the worker makes a session key and returns it only
sealed to that key (``sealed_key``), so a reader of the shared results topic learns nothing usable. Every later
request names its session and carries ``auth``, an HMAC under the session key over (request id, op, digest of the
request), so it can be neither forged nor altered; a request id already executed gets its first result again.
Opening from a snapshot needs the same proof from the session that took it (``snapshot_session``/
``snapshot_auth``). Requests of one session are keyed by the session id and sent to the partition the session lives
on, so they run in the order sent. See ``kiln.workers.exec.auth``.
"""

from __future__ import annotations

import base64
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.schemas.reports import TestReport

ExecOp = Literal["open", "write_files", "read_files", "delete_files", "apply_patch", "run", "run_tests", "lint",
                 "snapshot", "fork", "close", "run_once"]


class SessionLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_mb: int = Field(1024, ge=32, le=65536)
    cpus: float = Field(1.0, gt=0, le=64)
    pids: int = Field(256, ge=16, le=32768)
    disk_mb: int = Field(512, ge=8, le=65536, description="Size of the writable work area (/work and /tmp).")
    idle_timeout_s: float = Field(600.0, gt=0, le=24 * 3600)


class FileContent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096, description="Relative to /work.")
    content_b64: str | None = None
    text: str | None = None
    mode: int = Field(0o644, ge=0, le=0o777)

    @model_validator(mode="after")
    def _one_body(self) -> FileContent:
        if (self.text is None) == (self.content_b64 is None):
            raise ValueError("give exactly one of text and content_b64")
        return self


def file_content(path: str, content: str | bytes, mode: int = 0o644) -> FileContent:
    if isinstance(content, str):
        return FileContent(path=path, text=content, mode=mode)
    return FileContent(path=path, content_b64=base64.b64encode(content).decode(), mode=mode)


class RunStep(BaseModel):
    """One command of a ``run_once`` call; the steps run in order, each after the previous one succeeded (exit 0)
    unless it is ``always``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    command: str = Field(min_length=1, max_length=100_000)
    timeout_s: float = Field(60.0, gt=0, le=24 * 3600)
    stdin: str | None = Field(None, max_length=16 << 20, description="fed on the step's standard input")
    always: bool = Field(False, description="runs even when an earlier step failed (e.g. a collector)")


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    op: ExecOp
    session_id: str | None = Field(None, max_length=64)
    token: str | None = Field(None, max_length=128, description="Withdrawn (it travelled in the clear on the "
                              "shared results topic): a request that carries one is refused; prove with auth.")
    auth: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="HMAC-SHA256 under the session key.")
    client_key: str | None = Field(None, min_length=40, max_length=64,
                                   description="open/fork: the client's X25519 public key (base64).")
    snapshot_session: str | None = Field(None, max_length=64, description="open from a snapshot: who took it")
    snapshot_auth: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                                      description="open from a snapshot: HMAC under that session's key")
    image: str | None = Field(None, max_length=300, description="open: the image (a kiln build, or allowed prefix)")
    repository: str | None = Field(None, max_length=200)
    limits: SessionLimits = Field(default_factory=SessionLimits)
    snapshot: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$", description="fork/open from a snapshot")
    files: list[FileContent] = Field(default_factory=list, max_length=10_000)
    paths: list[str] = Field(default_factory=list, max_length=10_000)
    patch: str | None = Field(None, max_length=16 << 20)
    command: str | None = Field(None, max_length=100_000)
    timeout_s: float = Field(60.0, gt=0, le=24 * 3600)
    max_output_bytes: int = Field(64 * 1024, ge=0, le=16 << 20)
    steps: list[RunStep] = Field(default_factory=list, max_length=16,
                                 description="run_once: the commands, in order (or just ``command``)")
    env: dict[str, str] = Field(default_factory=dict, max_length=256, description="run_once: added environment")
    cwd: str = Field("", max_length=4096, description="run_once: where the steps run, relative to /work")
    tests: bool = Field(False, description="run_once: after the steps, the image's test command (as run_tests), "
                                           "its reports parsed into the result's ``tests``")

    @model_validator(mode="after")
    def _operands(self) -> ExecRequest:
        if self.op == "run_once":
            if not self.image:
                raise ValueError("run_once needs an image")
            if self.command and self.steps:
                raise ValueError("run_once takes a command or steps, not both")
            if not (self.command or self.steps or self.tests):
                raise ValueError("run_once needs a command, steps or tests")
            if len({s.name for s in self.steps}) != len(self.steps):
                raise ValueError("run_once step names must differ")
            return self
        if self.token is not None:
            raise ValueError("session tokens are withdrawn: sign requests with the session key (auth)")
        if self.op == "open" and not (self.image or self.snapshot):
            raise ValueError("open needs an image")
        if self.op in ("open", "fork") and not self.client_key:
            raise ValueError(f"{self.op} needs the client's public key (client_key)")
        if self.op == "open" and self.snapshot and not (self.snapshot_session and self.snapshot_auth):
            raise ValueError("open from a snapshot needs snapshot_session and snapshot_auth")
        if self.op != "open" and (not self.session_id or not self.auth):
            raise ValueError(f"{self.op} needs session_id and auth")
        if self.op == "run" and not self.command:
            raise ValueError("run needs a command")
        if self.op == "apply_patch" and not self.patch:
            raise ValueError("apply_patch needs a patch")
        return self


class CommandOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0


class StepOutput(CommandOutput):
    """A ``run_once`` step, measured by the runner's supervisor (never by the code it ran)."""

    name: str
    cpu_s: float = 0.0
    signal: int | None = Field(None, description="the signal that ended the step's process, if one did")


class LintFinding(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    line: int | None = None
    column: int | None = None
    code: str | None = None
    message: str


class ExecResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    op: ExecOp
    session_id: str
    token: str | None = Field(None, description="Withdrawn: never sent (see sealed_key).")
    sealed_key: str | None = Field(None, description="open/fork: the session key, sealed to the client's key.")
    partition: int | None = Field(None, description="Where this session's requests must be sent.")
    image: str | None = None
    warm: bool = Field(False, description="open: a ready container was taken from the warm pool")
    output: CommandOutput | None = None
    files: list[FileContent] = Field(default_factory=list)
    tests: TestReport | None = None
    findings: list[LintFinding] = Field(default_factory=list)
    snapshot: str | None = None
    snapshot_bytes: int | None = None
    steps: list[StepOutput] = Field(default_factory=list, description="run_once: the steps that ran, in order")
