"""The learning loop on one GPU with PyTorch, transformers and tokenizers only (no vLLM, no SGLang): a Hugging Face
causal LM (a Llama built here: a BPE tokenizer trained on the task's text, random init) served by kiln's own engine
and trained by kiln's own trainer on the same device, async against sync in one run.

One GPU cannot hold both ends of an NCCL group, so the server lives in the trainer's process (``kiln rl train
--serve-port``, ``rl/colocate.py``): each step's weights go to the engine by a device-to-device copy,
swapped in between two decode steps, while the completion routes keep answering the rollout workers. Everything
else is the stages as any run has them (``LearningRun``): the broker (started as bench/common.py does), rollout
workers with the in-process ``exact_match`` verifier, the actor, held-out greedy evaluation.

Per seed and mode (``--seeds``, interleaved: async s1, sync s1, async s2, ...):
- ``rl_gpu_time_to_target_<mode>_s<seed>`` (its whole wall-clock if it missed, and then
  ``rl_reached_target_<mode>_gpu_s<seed>`` is 0), ``rl_gpu_samples_per_s_<mode>_s<seed>``,
  ``rl_gpu_s_per_step_<mode>_s<seed>`` (first step's end to the last's);
- ``rl_gpu_paused_ms_per_update_<mode>_s<seed>``: how long decoding stood still for each weight swap (mean);
- ``rl_gpu_groups_across_updates_<mode>_s<seed>``: the share of groups whose sampling had a weight update land in
  it (version at start < version at end): rollouts continuing through updates;
- ``rl_gpu_lag_versions_<mode>_s<seed>``: mean versions between a sample's first token and the step training it;
- ``rl_async_vs_sync_time_to_target_gpu_s<seed>`` (sync ÷ async, or a bound when a run missed the target) and
  ``rl_gpu_async_vs_sync_s_per_step_s<seed>`` (sync ÷ async seconds per step).
Records and the ``kiln rl report`` picture go to ``--record-dir``.

Usage (a GPU machine, the repository's environment with the rl extra):
    python -m bench.rl_gpu --device cuda [--hidden 64 --layers 2] [--steps 200] [--seeds 1,2,3] [--target 0.1]
Dry check on a CPU (tiny sizes, a few steps; the figures mean nothing there):
    python -m bench.rl_gpu --device cpu --steps 4 --groups-per-step 4 --deadline 240 --target 1.1
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench.common import console, learning_runs, report
from bench.rl import mean_lag, seconds_per_step, time_to_target
from kiln.rl.local import LearningRun, RunConfig, RunRecord
from kiln.rl.report import write_report
from kiln.rl.tasks import Addition
from kiln.rl.train import ROLLOUTS
from kiln.schemas.rl import RolloutGroup
from kiln.streams.replay import read_topic
from kiln.workers.inference.hf import build_tiny_model


def build_model(args: argparse.Namespace, seed: int) -> Path:
    """The run's model: ``--model`` as given, or a Llama of ``--hidden``/``--layers`` built for the task (the
    defaults are ``local.addition_model``'s, the shape measured to learn on a CPU)."""
    if args.model:
        return Path(args.model)
    corpus = [t.prompt + t.answer for t in Addition(1, seed=seed).sample(300)]
    return build_tiny_model(args.record_dir / f"model-s{seed}", corpus, vocab_size=args.vocab, hidden=args.hidden,
                            layers=args.layers, heads=args.heads, seed=seed, max_len=128)


def run_metrics(record: RunRecord, groups: list[RolloutGroup], mode: str, seed: int) -> dict[str, float]:
    t = record.time_to_target
    updates = [u for _t, u in record.updates]
    name = f"{mode}_s{seed}"
    return {f"rl_gpu_time_to_target_{name}": record.wall_s if t is None else t,
            f"rl_gpu_samples_per_s_{name}": record.samples_per_s,
            f"rl_gpu_s_per_step_{name}": seconds_per_step([t for t, _u in record.updates]),
            f"rl_gpu_paused_ms_per_update_{name}": sum(u.paused_ms for u in updates) / max(len(updates), 1),
            f"rl_gpu_groups_across_updates_{name}": sum(g.version_end > g.version_start for g in groups)
            / max(len(groups), 1),
            f"rl_gpu_lag_versions_{name}": mean_lag(record),
            f"rl_gpu_lineage_ok_{name}": float(record.lineage_ok)}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the engine's (the trainer keeps float32 weights)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="the trainer's autocast")
    parser.add_argument("--model", default="", help="a Hugging Face model's directory (default: build one)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=110)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--groups-per-step", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--entropy-coef", type=float, default=0.003)
    parser.add_argument("--target", type=float, default=0.1)
    parser.add_argument("--deadline", type=float, default=300)
    parser.add_argument("--rollout-workers", type=int, default=2)
    parser.add_argument("--record-dir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-bench-rl-gpu")
    args = parser.parse_args()
    settings = learning_runs(args.record_dir)
    metrics: dict[str, float] = {}
    records: list[RunRecord] = []
    for seed in args.seeds:
        model = build_model(args, seed)
        by_mode: dict[str, RunRecord] = {}
        for mode in ("async", "sync"):
            config = RunConfig(name=f"{mode} s{seed}", sync=mode == "sync", model=str(model), colocate=True,
                               device=args.device, dtype=args.dtype, precision=args.precision, steps=args.steps,
                               groups_per_step=args.groups_per_step, lr=args.lr, entropy_coef=args.entropy_coef,
                               max_ahead=3 * args.groups_per_step, target=args.target, deadline_s=args.deadline,
                               seed=seed, eval_every_s=5, rollout_workers=args.rollout_workers)
            console.print(f"[bold]{config.name}[/] on {args.device}: up to {args.steps} steps, {args.deadline:.0f} s "
                          f"or greedy accuracy {args.target}")
            run = LearningRun(settings, config)
            record = await run.run()
            groups = [RolloutGroup.model_validate_json(m.value() or b"") for m in read_topic(run.settings, ROLLOUTS)]
            (args.record_dir / f"{mode}-s{seed}.json").write_text(record.model_dump_json())
            metrics |= run_metrics(record, groups, mode, seed)
            by_mode[mode] = record
            records.append(record)
        fast, slow = by_mode["async"], by_mode["sync"]
        metrics |= time_to_target(fast.time_to_target, fast.wall_s, slow.time_to_target, slow.wall_s,
                                  f"_gpu_s{seed}")
        metrics[f"rl_gpu_async_vs_sync_s_per_step_s{seed}"] = (metrics[f"rl_gpu_s_per_step_sync_s{seed}"]
                                                               / metrics[f"rl_gpu_s_per_step_async_s{seed}"])
    png = write_report(records, args.record_dir / "rl-gpu-report.png")
    report(f"learning loop on one device ({args.device}): async vs sync", metrics, {"report": str(png)})


if __name__ == "__main__":
    asyncio.run(main())
