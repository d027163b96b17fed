"""The learning loop, asynchronous (PipelineRL: sampling never waits for training, weights arrive in flight) against
the conventional synchronous loop (``--sync``: one step's groups, wait, train, repeat), in the same run, the same
code, the same seed and sample budget, every part its own process (``LearningRun``), rewards from the exec stage.

- ``rl_async_vs_sync_time_to_target``: wall-clock until greedy accuracy first reaches ``--target``, sync ÷ async,
  when both runs reach it. When one does not, its whole wall-clock stands in and the figure is named for what it
  then is: ``..._lower_bound`` (sync missed) or ``..._upper_bound`` (async missed); when neither does, there is no
  ratio. ``rl_reached_target_async`` / ``_sync`` (1 or 0) say which runs reached it.
- ``rl_samples_per_s_async`` / ``_sync``: samples trained on ÷ wall-clock.
- ``rl_inference_paused_fraction``: the async run's decoding pause for weight updates ÷ wall-clock, as the
  inference server reports it (its own measure; bench/inference.py measures pauses from the client side).
- ``rl_mean_lag_versions``: the async run's mean versions between a sample's first token and its training step.
Writes each run's record and the PNG of ``kiln rl report`` to ``--record-dir``.
Usage: python -m bench.rl [--steps 300] [--target 0.35] [--deadline 420] [--seed 1] [--in-process]
(--in-process: verify without exec)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from pathlib import Path

from rich.logging import RichHandler

from bench.common import broker, console, report
from bench.exec import build_image
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.workers.common.containers import docker_client
from kiln.workers.rollout.local import LearningRun, RunConfig, RunRecord
from kiln.workers.rollout.report import paused_fraction, write_report


def mean_lag(record: RunRecord) -> float:
    samples = sum(u.samples for _t, u in record.updates)
    return sum(u.lag_mean * u.samples for _t, u in record.updates) / samples if samples else 0.0


def time_to_target(async_s: float | None, async_wall: float, sync_s: float | None,
                   sync_wall: float) -> dict[str, float]:
    """The sync ÷ async time-to-target figure, named for what it is when a run missed the target (its wall-clock
    then stands in for the time it never reached), with which runs reached it."""
    reached = {"rl_reached_target_async": float(async_s is not None),
               "rl_reached_target_sync": float(sync_s is not None)}
    if async_s is not None and sync_s is not None:
        return {"rl_async_vs_sync_time_to_target": sync_s / async_s, **reached}
    if async_s is not None:  # sync would have needed longer than its whole run
        return {"rl_async_vs_sync_time_to_target_lower_bound": sync_wall / async_s, **reached}
    if sync_s is not None:  # async would have needed longer than its whole run
        return {"rl_async_vs_sync_time_to_target_upper_bound": sync_s / async_wall, **reached}
    return reached


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.35)
    parser.add_argument("--deadline", type=float, default=420)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--record-dir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-bench-rl")
    args = parser.parse_args()
    # The runs log each evaluation and kill (kiln.rl.run): that is the bench's progress.
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    logging.getLogger("kiln.rl.run").setLevel(logging.INFO)
    settings = broker()
    image = None
    if not args.in_process:
        run_steps(COMPONENT_STEPS["docker"])
        with tempfile.TemporaryDirectory() as tmp:
            image = await build_image(Path(tmp), docker_client())
    records: dict[str, RunRecord] = {}
    for name in ("async", "sync"):
        config = RunConfig(name=name, sync=name == "sync", steps=args.steps, target=args.target,
                           deadline_s=args.deadline, exec_image=image, seed=args.seed)
        console.print(f"[bold]{name}[/] run: up to {args.steps} steps or greedy accuracy {args.target}")
        records[name] = await LearningRun(settings, config).run()
        args.record_dir.mkdir(parents=True, exist_ok=True)
        (args.record_dir / f"{name}.json").write_text(records[name].model_dump_json())
    png = write_report(list(records.values()), args.record_dir / "rl-report.png")
    fast, slow = records["async"], records["sync"]
    reached = {name: r.time_to_target for name, r in records.items()}
    report("learning loop: async vs sync", {
        **time_to_target(reached["async"], fast.wall_s, reached["sync"], slow.wall_s),
        "rl_samples_per_s_async": fast.samples_per_s, "rl_samples_per_s_sync": slow.samples_per_s,
        "rl_inference_paused_fraction": paused_fraction(fast), "rl_mean_lag_versions": mean_lag(fast),
        "rl_final_accuracy_async": fast.evaluations[-1].accuracy,
        "rl_final_accuracy_sync": slow.evaluations[-1].accuracy,
    }, {"time to target (s)": ", ".join(
            f"{name} {f'{t:.0f}' if t is not None else f'missed (whole run {r.wall_s:.0f} s)'}"
            for name, r, t in (("async", fast, reached["async"]), ("sync", slow, reached["sync"]))),
        "lineage exact": f"async {fast.lineage_ok}, sync {slow.lineage_ok}", "report": str(png)})


if __name__ == "__main__":
    asyncio.run(main())
