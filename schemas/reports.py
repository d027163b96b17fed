"""Models shared by several stages: per-test results and the unified coverage report (builder and exec)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TestCaseResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    outcome: Literal["passed", "failed", "skipped", "error"]
    duration_s: float | None = None
    message: str = ""


class FileCoverage(BaseModel):
    """Line coverage of one source file, in the same shape whatever tool measured it."""

    model_config = ConfigDict(extra="forbid")

    path: str
    executable_lines: list[int] = Field(default_factory=list)
    covered_lines: list[int] = Field(default_factory=list)


class CoverageReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool: str
    files: list[FileCoverage] = Field(default_factory=list)
    lines_total: int = 0
    lines_covered: int = 0


class TestReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runner: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    cases: list[TestCaseResult] = Field(default_factory=list)
    coverage: CoverageReport | None = None
    itemised: bool = Field(True, description="Per-test results were read. False: the runner left none kiln can "
                                             "read (``cases`` empty, the counts 0); its summary, if any, below.")
    summary_passed: int | None = Field(None, description="Tests passed by the runner's own summary line, if it "
                                                         "printed one (checked against the per-test results).")
    summary_failed: int | None = Field(None, description="Tests failed by the runner's own summary line.")
