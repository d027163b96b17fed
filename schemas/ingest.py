"""Saucer's messages: what ``repo.ingest`` carries and what ``repo.events`` reports."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

REPO_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"
"""Repository names: slash-separated components that start with a letter or digit (so ``-`` never is one)."""

DEFAULT_REFS = ["refs/heads/*", "refs/tags/*"]


class HistoryRewrite(BaseModel):
    """Derive a repository from an ingested one by rewriting its history.

    ``truncate``: history up to ``revision`` (it becomes ``refs/heads/main``); ``squash``: one root commit with the
    tree of ``revision``; ``remove_path``: every commit of every ref without ``path`` (percent-encoded bytes).
    """

    model_config = ConfigDict(extra="forbid")

    source: str = Field(pattern=REPO_NAME, max_length=200)
    operation: Literal["truncate", "squash", "remove_path"]
    revision: str | None = Field(None, max_length=256)
    path: str | None = Field(None, max_length=4096)

    @model_validator(mode="after")
    def _operands(self) -> HistoryRewrite:
        if self.operation == "remove_path" and not self.path:
            raise ValueError("remove_path needs a path")
        if self.operation in ("truncate", "squash") and not self.revision:
            raise ValueError(f"{self.operation} needs a revision")
        return self


class IngestRequest(BaseModel):
    """Ingest ``location`` (git URL, ``file://``, local path, bare repo) as ``name``, or derive ``name`` by a rewrite.

    ``refs`` are glob patterns over full ref names. ``pin`` fixes refs to exact commits (a rebuild replays the
    commits an earlier ingestion recorded, whatever the remote holds now).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=REPO_NAME, max_length=200)
    location: str | None = Field(None, min_length=1, max_length=4096)
    refs: list[str] = Field(default_factory=lambda: list(DEFAULT_REFS), min_length=1, max_length=64)
    pin: dict[str, str] | None = Field(None, max_length=4096, description="ref name -> 40-hex commit id")
    rewrite: HistoryRewrite | None = None

    @model_validator(mode="after")
    def _one_source(self) -> IngestRequest:
        if (self.location is None) == (self.rewrite is None):
            raise ValueError("give exactly one of location and rewrite")
        return self

    @property
    def root(self) -> str:
        """The repository whose partition this request belongs on: a rewrite follows its source."""
        return self.rewrite.source if self.rewrite else self.name


IngestStatus = Literal["ingested", "failed"]
FailureReason = Literal["invalid_location", "not_found", "auth", "timeout", "no_refs", "pin_unavailable",
                        "source_missing", "bad_rewrite", "error"]


class IngestEvent(BaseModel):
    """One ingestion's outcome, on ``repo.events`` (keyed by repository) and as the request's result."""

    model_config = ConfigDict(extra="forbid")

    repository: str
    request_id: str
    status: IngestStatus
    location: str
    strategy: Literal["parallel", "single", "rewrite", "none"] = "none"
    refs: dict[str, str] = Field(default_factory=dict, description="ref name -> commit id, as stored")
    head: str | None = None
    commits: int = 0
    objects: int = 0
    pack_bytes: int = 0
    manifest: str | None = Field(None, description="Digest of the stored manifest: equal content, equal digest.")
    duration_s: float = 0.0
    reason: FailureReason | None = None
    detail: str | None = None
