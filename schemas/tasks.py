"""Task health (``kiln tasks health``): the latest finding on each repository task, keyed by task id on the compacted
``kiln.tasks.health`` topic. Task sources that honour it (``RepositoryTasks``) never serve a quarantined task; the
status page shows the healthy share per task source."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

HealthStatus = Literal["healthy", "quarantined", "unchecked"]
"""``unchecked``: no check has judged the task yet (each try failed for kiln's reasons); it is still served."""

QuarantineReason = Literal["image_does_not_start", "patch_does_not_apply", "tests_not_usable", "gold_fails", "flaky",
                           "passes_without_fix", "operator"]
"""Why a task is quarantined: its image does not start (the engine and the registry have no such image, or it records
no test command); its test or gold patch no longer applies; no run with the gold patch gave per-test results kiln
trusts; a FAIL_TO_PASS / PASS_TO_PASS test failed in every run with the gold patch; one failed in more than the
allowed share of them; a FAIL_TO_PASS test passed without the gold patch (a patch that changes nothing would be
rewarded); or an operator said so (``kiln tasks quarantine``; only ``kiln tasks release`` lifts it)."""


class TestHealth(BaseModel):
    """One contract test that did not behave in the last check: it failed in some runs with the gold patch, or (a
    FAIL_TO_PASS test) passed in some run without it."""

    __test__ = False  # not a pytest class, despite the name
    model_config = ConfigDict(extra="forbid")

    name: str
    contract: Literal["fail_to_pass", "pass_to_pass"]
    failed_runs: int = Field(ge=0, description="Runs with the gold patch in which it did not pass.")
    runs: int = Field(ge=0, description="Runs with the gold patch.")
    passed_without_fix: int = Field(0, ge=0, description="Runs without the gold patch in which it passed "
                                                         "(FAIL_TO_PASS only).")


class TaskHealth(BaseModel):
    """The health of one task: the status its task sources obey, the evidence of its last complete check, and kiln's
    own failures while trying (counted apart: they never quarantine a task)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(min_length=1, max_length=1000, description="``<source>:<problem id>``, as "
                                                                     "``RepositoryTasks`` names its tasks.")
    source: str = Field(min_length=1, max_length=500, description="The task source (the repository).")
    image: str = Field("", max_length=1000)
    status: HealthStatus
    reason: QuarantineReason | None = Field(None, description="Why it is quarantined (None otherwise).")
    detail: str = Field("", max_length=4000, description="The evidence in words.")
    checked_at: float | None = Field(None, description="Unix time of the last check that judged the task.")
    runs: int = Field(0, ge=0, description="Runs with the test and gold patches in that check.")
    runs_without_fix: int = Field(0, ge=0, description="Runs with the test patch alone in that check.")
    gold_passed_runs: int = Field(0, ge=0, description="Runs with the gold patch in which every FAIL_TO_PASS and "
                                                       "PASS_TO_PASS test passed (what the swe verifier rewards 1).")
    tests: list[TestHealth] = Field(default_factory=list, max_length=200,
                                    description="Contract tests that misbehaved in that check, worst first.")
    image_start_failures: int = Field(0, ge=0, description="Runs of that check whose image did not start.")
    healthy_checks: int = Field(0, ge=0, description="Consecutive checks that found the task healthy.")
    infra_failures: int = Field(0, ge=0, description="Runs that failed for kiln's reasons (exec unavailable, a "
                                                     "request expired or lost, the engine) in the last try, after "
                                                     "retries.")
    infra_detail: str = Field("", max_length=2000)
    infra_at: float | None = Field(None, description="Unix time of the last try that kiln's failures left unjudged.")
    operator_note: str = Field("", max_length=2000, description="What the operator said with ``kiln tasks "
                                                                "quarantine`` or ``release``.")
    updated_at: float = Field(description="Unix time this record was written.")
