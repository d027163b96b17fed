"""The image builder's messages: a repository revision in, a build event out."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.ingest import REPO_NAME
from kiln.schemas.reports import TestReport

FailureClass = Literal["no_rule_matched", "dependency_install_failed", "compile_failed", "tests_did_not_run",
                       "tests_not_itemised", "timeout", "infrastructure", "toolchain_unavailable"]


class BuildRequest(BaseModel):
    """Build ``repository`` (as stored in Saucer) at ``revision`` into an image and run its tests."""

    model_config = ConfigDict(extra="forbid")

    repository: str = Field(pattern=REPO_NAME, max_length=200)
    revision: str = Field("HEAD", min_length=1, max_length=256)
    run_tests: bool = True
    timeout_s: float = Field(1800.0, gt=0, le=6 * 3600)
    layered: bool = Field(False, description="Build as one layer on the image of the revision's parent (its base "
                                             "image when none), pushed to the registry; see workers/builder/layers.py")
    force: bool = Field(False, description="Rebuild from scratch (no build cache, no dependency image, no Docker "
                                           "layer cache), even when this (repository, commit, rules) was built.")


class Decision(BaseModel):
    """One step of the rules' reasoning, kept in the event so a build can be explained."""

    model_config = ConfigDict(extra="forbid")

    topic: str
    choice: str
    reason: str


class BuildEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repository: str
    revision: str
    commit: str | None = None
    rules_version: int
    status: Literal["built", "failed"]
    usable: bool = Field(False, description="It built, and its suite gave per-test results with >= 1 passing test "
                                           "that agree with the runner's own summary (whatever the other verdicts).")
    system: str | None = Field(None, description="Build system chosen: python, cargo, go, npm, cmake, make.")
    recipe: Literal["rules", "dockerfile", "agent"] | None = Field(
        None, description="What produced the image: the build-system rules, the repository's Dockerfile, or the "
                          "fallback agent (README/CI commands, or a model).")
    decisions: list[Decision] = Field(default_factory=list)
    toolchain: dict[str, str] = Field(default_factory=dict)
    image: str | None = None
    image_id: str | None = None
    dependency_image: str | None = None
    dependency_layer_cached: bool = False
    cached: bool = Field(False, description="This build was found in the build cache, not rebuilt.")
    revision_image: Literal["base", "layer", "same"] | None = Field(
        None, description="Layered builds: a new base image, one layer on the parent's image, or the parent's image.")
    parent_commit: str | None = None
    failure: FailureClass | None = None
    detail: str | None = None
    tests: TestReport | None = None
    durations_s: dict[str, float] = Field(default_factory=dict)
