"""Autoscaling, bounded: the simulated cluster (same decision function) beats the CPU-only baseline, and on this
machine a spike on one worker is scaled up, cleared within Cm, and scaled back down with SIGTERM — no job lost or
run twice, every logged decision recomputable from its logged inputs."""

from __future__ import annotations

from pathlib import Path

from bench.autoscale import SimConfig, local_run, simulate
from kiln.streams.settings import KilnSettings


def test_simulated_spike_clears_in_ten_minutes_and_beats_cpu_only() -> None:
    seed, cpu = simulate(SimConfig(), seed_rule=True), simulate(SimConfig(), seed_rule=False)
    assert seed["scaleup_1_to_100_s"] <= 600 and seed["queue_clear_s"] <= 600
    assert cpu["queue_clear_s"] > 2 * seed["queue_clear_s"]


def test_a_spike_is_scaled_up_cleared_within_cm_and_scaled_down(kafka: KilnSettings, tmp_path: Path) -> None:
    # 400 one-second jobs: one worker of 4 slots alone needs 100 s; Cm is 60 s.
    run = local_run(kafka, tmp_path, jobs=400, job_s=1.0, slots=4, tick_s=10, goal_minutes=1.0, max_workers=6)
    assert len(run["ok"]) == 400
    assert sorted(run["ends"]) == sorted(run["ok"]), "a job ran that was not answered, or the reverse"
    assert len(run["starts"]) == len(set(run["starts"])) == 400, "a job started twice"
    assert run["peak_workers"] > 1 and run["clear_s"] <= 60
    chosen = [e["decision"]["chosen"] for e in run["decisions"]]
    assert chosen[-1] == 1 and max(chosen) == run["peak_workers"]
    assert all({"queue_length", "completions_per_min", "workers_avg"} <= e["inputs"].keys() for e in run["decisions"])
    assert run["audit"] == []
