"""A bounded smoke run of bench/rl.py at small sizes, both its parts: the overhead part (a learning run through the
stages beside the same loop in one process) and the modes part (async and sync runs of one seed). It ran at its
defaults until a run deleted its topics before the bench read them; this keeps both parts running. No timing is
asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


def test_both_parts_run_and_report(kafka: object, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-m", "bench.rl", "--steps", "2", "--overhead-steps", "3", "--seeds", "1",
                           "--deadline", "60", "--target", "0.99", "--groups-per-step", "8", "--rollout-workers", "1",
                           "--record-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = {line.split()[1]: float(line.split()[2]) for line in done.stdout.splitlines()
               if line.startswith("METRIC ")}
    assert metrics["rl_stage_overhead_ratio"] > 0 and metrics["rl_inprocess_s_per_step"] > 0  # part 1
    assert {"rl_s_per_step_async_s1", "rl_s_per_step_sync_s1"} <= set(metrics)  # part 2
    assert (tmp_path / "rl-report.png").exists()
