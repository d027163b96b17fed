"""A bounded smoke run of bench/dispatch.py's stage paths (8 run_once calls, 8 verify requests, 4 in flight): both
answer right and every CPU-per-job figure exists, kiln's share the sum of its parts. No timing is asserted."""

from __future__ import annotations

import pytest

from bench.common import broker
from bench.dispatch import parse, stage_paths

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


async def test_the_stage_paths_answer_and_report() -> None:
    metrics = await stage_paths(broker(), parse(["--exec-jobs", "8", "--verify-requests", "8",
                                                 "--stage-concurrency", "4"]))
    assert metrics["dispatch_runonce_errors"] == metrics["dispatch_verify_errors"] == 0
    parts = {"runonce": ("client", "worker", "broker"), "verify": ("client", "verify_worker", "exec_worker", "broker")}
    for path, kiln in parts.items():
        assert metrics[f"dispatch_{path}_jobs_per_s"] > 0
        for part in (*kiln, "sandboxes", "docker"):
            assert metrics[f"dispatch_{path}_cpu_us_per_job_{part}"] >= 0
        assert metrics[f"dispatch_{path}_cpu_us_per_job_kiln"] == pytest.approx(
            sum(metrics[f"dispatch_{path}_cpu_us_per_job_{part}"] for part in kiln))
