"""``kiln rl report`` and what it plots, read directly (rl/report.py, the ``report`` command of
rl/cli.py), and how bench/rl.py names its time-to-target figure when a run misses the target."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from bench.rl import time_to_target
from kiln.rl.cli import app
from kiln.rl.local import Evaluation, RunConfig, RunRecord
from kiln.rl.report import lag_histogram, paused_fraction, write_report
from kiln.schemas.rl import PolicyUpdate


def _update(version: int, histogram: dict[int, int]) -> PolicyUpdate:
    return PolicyUpdate(version=version, checkpoint=f"c{version}", groups=2, groups_total=2 * version,
                        samples=sum(histogram.values()), reward_mean=0.1 * version, loss=1.0, entropy=0.5,
                        step_s=0.2, lag_mean=1.0, lag_max=max(histogram), lag_histogram=histogram,
                        servers_updated=1, servers_failed={})


def _record(name: str, wall_s: float, paused_s: float) -> RunRecord:
    return RunRecord(config=RunConfig(name=name, sync=name == "sync", target=0.3), wall_s=wall_s,
                     evaluations=[Evaluation(t=1.0, version=1, accuracy=0.1), Evaluation(t=9.0, version=4,
                                                                                          accuracy=0.4)],
                     updates=[(2.0, _update(1, {0: 6, 2: 1})), (5.0, _update(2, {2: 3, 1: 4}))], paused_s=paused_s,
                     rollouts=4, trained_groups=4, lineage_ok=True, versions_monotonic=True, kills=[],
                     dead_letters=0, verified_by={})


def test_lag_histogram_sums_every_update_and_paused_fraction_is_of_the_wall_clock() -> None:
    record = _record("async", wall_s=20.0, paused_s=0.5)
    assert lag_histogram(record) == {0: 6, 1: 4, 2: 4}
    assert list(lag_histogram(record)) == [0, 1, 2]  # sorted by lag, for the bars
    assert paused_fraction(record) == 0.025
    assert paused_fraction(record.model_copy(update={"wall_s": 0.0})) == 0.0


def test_the_report_command_plots_the_records_into_a_png(tmp_path: Path) -> None:
    paths = []
    for record in (_record("async", 20.0, 0.5), _record("sync", 30.0, 0.0)):
        paths.append(tmp_path / f"{record.config.name}.json")
        paths[-1].write_text(record.model_dump_json())
    out = tmp_path / "plots" / "rl.png"
    result = CliRunner().invoke(app, ["report", *map(str, paths), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert write_report([], tmp_path / "empty.png").exists()  # no records: an empty figure, not an error


def test_a_missed_target_is_named_a_bound_not_a_time() -> None:
    both = time_to_target(100.0, 150.0, 300.0, 320.0)
    assert both == {"rl_async_vs_sync_time_to_target": 3.0, "rl_reached_target_async": 1.0,
                    "rl_reached_target_sync": 1.0}
    sync_missed = time_to_target(100.0, 150.0, None, 420.0)
    assert sync_missed == {"rl_async_vs_sync_time_to_target_lower_bound": 4.2, "rl_reached_target_async": 1.0,
                           "rl_reached_target_sync": 0.0}
    async_missed = time_to_target(None, 420.0, 210.0, 300.0)
    assert async_missed == {"rl_async_vs_sync_time_to_target_upper_bound": 0.5, "rl_reached_target_async": 0.0,
                            "rl_reached_target_sync": 1.0}
    assert time_to_target(None, 420.0, None, 420.0) == {"rl_reached_target_async": 0.0,
                                                        "rl_reached_target_sync": 0.0}
