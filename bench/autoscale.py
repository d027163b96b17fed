"""Autoscaling: Harmonic's REPL service rule (``streams/autoscale/decide.py``) in a simulated cluster against an
HPA-style CPU-only baseline, and the real thing on this machine (stats app + ``kiln autoscale run`` + worker processes).

Simulation: pods start 60-90 s after they are asked for, job times are log-normal, a spike needs ~100 pods to
clear in Cm. Both runs see the same jobs and start delays (one seed). The rule's minimum is recomputed each minute
from the same per-minute numbers the stats stream publishes; the CPU trigger (Kubernetes' HPA: desired =
ceil(ready pods x utilisation / target), unready pods counted idle, at most +100 % or +4 pods per 15 s) runs in both,
and the cluster size is the larger of the two — what KEDA does with a metrics-api and a cpu trigger.

    python -m bench.autoscale                       # both, METRIC lines
    python -m bench.autoscale --skip-local          # simulation only (seconds)
    python -m bench.autoscale --baseline            # also the spike on one worker, measured here

The ``sim_*`` figures, the CPU-only baseline among them, come from the simulation only: an HPA needs a cluster.
What this machine measures is ``local_*``: ``local_peak_workers`` counts workers seen running jobs at the same
moment in the sleep journal (``local_peak_workers_decided`` is the autoscaler's largest decision), and
``--baseline`` measures the same spike with one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import broker, console, report
from kiln.schemas.builtin import SleepRequest
from kiln.streams import admin
from kiln.streams.autoscale.decide import Inputs, Policy, decide
from kiln.streams.autoscale.loop import Autoscaler
from kiln.streams.client import KilnClient
from kiln.streams.processes import StatsProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import COMPACTED, HEARTBEATS_TOPIC, STATS_TOPIC, TopicSpec

HPA_PERIOD_S = 15
HPA_TARGET = 0.9


@dataclass
class SimConfig:
    pods_needed: int = 100
    slots: int = 4
    job_median_s: float = 20.0
    job_sigma: float = 0.6
    goal_minutes: float = 5.0
    max_pods: int = 100
    start_delay_s: tuple[float, float] = (60.0, 90.0)
    background_per_s: float = 0.1
    horizon_s: int = 4 * 3600
    seed: int = 0


def simulate(cfg: SimConfig, seed_rule: bool) -> dict[str, float]:
    """One simulated run: seconds until 100 pods are ready and until the spike's queue is empty."""
    rng = random.Random(cfg.seed)
    mean_job = cfg.job_median_s * math.exp(cfg.job_sigma ** 2 / 2)
    spike = int(cfg.pods_needed * cfg.slots * cfg.goal_minutes * 60 / mean_job)
    durations = [rng.lognormvariate(math.log(cfg.job_median_s), cfg.job_sigma) for _ in range(spike + 100_000)]
    delays = [rng.uniform(*cfg.start_delay_s) for _ in range(10_000)]
    queue, next_job = spike, 0
    ready: list[float] = [0.0]  # ready-at times of requested pods (the first one is up)
    running: list[float] = []  # end times of running jobs
    finished: deque[float] = deque()
    ready_history: deque[int] = deque()
    policy = Policy(goal_minutes=cfg.goal_minutes, max_workers=cfg.max_pods, slots_per_worker=cfg.slots,
                    busy_trigger=False, min_workers=1)
    seed_min, hpa, streak, arrival_debt = 1, 1, 0, 0.0
    scaleup_s = clear_s = float("nan")
    peak = 1
    for t in range(cfg.horizon_s):
        while running and running[0] <= t:
            heapq.heappop(running)
            finished.append(t)
        arrival_debt += cfg.background_per_s
        queue += int(arrival_debt)
        arrival_debt -= int(arrival_debt)
        up = sum(1 for r in ready if r <= t)
        while queue and len(running) < up * cfg.slots:
            heapq.heappush(running, t + durations[next_job])
            next_job += 1
            queue -= 1
        while finished and finished[0] <= t - 60:
            finished.popleft()
        ready_history.append(up)
        peak = max(peak, up)
        if len(ready_history) > 60:
            ready_history.popleft()
        if math.isnan(scaleup_s) and up >= min(cfg.pods_needed, cfg.max_pods):
            scaleup_s = t
        if math.isnan(clear_s) and next_job >= spike and queue == 0:
            clear_s = t
        if not (math.isnan(scaleup_s) or math.isnan(clear_s)):
            break
        if seed_rule and t % 60 == 59:
            bmin = sum(ready_history) / len(ready_history)
            decision = decide(Inputs(queue_length=queue, completions_per_min=len(finished), workers_avg=bmin,
                                     slots_avg=bmin * cfg.slots, busy_now=len(running), current=len(ready),
                                     down_streak=streak), policy)
            seed_min, streak = decision.chosen, decision.down_streak
        if t % HPA_PERIOD_S == HPA_PERIOD_S - 1:
            utilisation = len(running) / max(1, len(ready) * cfg.slots)  # unready pods count as idle
            wanted = math.ceil(round(len(ready) * utilisation / HPA_TARGET, 9))
            hpa = min(cfg.max_pods, max(1, min(wanted, max(2 * len(ready), len(ready) + 4))))
        target = max(hpa, seed_min if seed_rule else 1)
        while len(ready) < target:  # (scale-down happens after both figures are in: not simulated)
            ready.append(t + delays[len(ready) % len(delays)])
    return {"scaleup_1_to_100_s": scaleup_s, "queue_clear_s": clear_s, "spike_jobs": float(spike),
            "peak_pods": float(peak)}


# ---- the real run on this machine ---------------------------------------------------------------------------


def _topics(settings: KilnSettings) -> None:
    admin.create_topics(settings, [TopicSpec("kiln.results", 2), TopicSpec(HEARTBEATS_TOPIC, 1, COMPACTED),
                                   TopicSpec(STATS_TOPIC, 1, COMPACTED), TopicSpec("sleep.requests", 8),
                                   TopicSpec("sleep.requests.dlq", 1)])


async def _spike(settings: KilnSettings, jobs: int, job_s: float) -> tuple[list[str], float]:
    async with KilnClient(settings) as client:
        started = time.monotonic()
        # A key per job: the spike spreads over every partition, so added workers have work to take.
        futures = [await client.submit("sleep", SleepRequest(seconds=job_s, tag=f"spike{i}"), key=f"spike{i}")
                   for i in range(jobs)]
        results = await asyncio.gather(*futures)
        return [r.request_id for r in results if r.status == "ok"], time.monotonic() - started


def local_run(settings: KilnSettings, work: Path, *, jobs: int, job_s: float, slots: int, tick_s: float,
              goal_minutes: float, max_workers: int, down_ticks: int = 2) -> dict[str, Any]:
    """A spike on a stage with one worker; the autoscaler (local backend) scales up, the queue clears, it scales
    back down with SIGTERM. Returns the figures, the decision log and what the journal says ran."""
    settings = settings.model_copy(update={"topic_prefix": f"as{uuid.uuid4().hex[:8]}.", "cache": work / "cache"})
    _topics(settings)
    journal, decisions = work / "journal", work / "decisions.jsonl"
    env = {**os.environ, "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache),
           "KILN_HEARTBEAT_S": "1", "KILN_SLEEP_JOURNAL": str(journal), "KILN_GRACE_S": "30"}
    stats = StatsProcess(settings, work / "stats.log")
    scaler_port = free_port()
    scaler = subprocess.Popen(
        [sys.executable, "-m", "kiln.streams.cli", "autoscale", "run", "sleep", "--backend", "local",
         "--stats-url", stats.url, "--tick-s", str(tick_s), "--goal-minutes", str(goal_minutes),
         "--max", str(max_workers), "--slots", str(slots), "--job-seconds-guess", str(job_s),
         "--down-ticks", str(down_ticks), "--worker-arg=--group=g-autoscale", "--log-dir", str(work / "workers"),
         "--decision-log", str(decisions), "--port", str(scaler_port)],
        env=env, stdout=(work / "autoscale.log").open("w"), stderr=subprocess.STDOUT)
    try:
        stats.wait("sleep", lambda s: s["workers_now"] == 1, timeout=90)
        console.print(f"[bold]spike[/] {jobs} jobs of {job_s:g} s on one worker of {slots} slots")
        ok, clear_s = asyncio.run(_spike(settings, jobs, job_s))
        console.print(f"queue cleared in {clear_s:.1f} s; waiting for the scale-down")
        settled = time.monotonic()
        stats.wait("sleep", lambda s: s["workers_now"] == 1 and s["queue_length"] == 0,
                   timeout=tick_s * (down_ticks + 3) + 60)
        scaledown_s = time.monotonic() - settled
    finally:
        scaler.terminate()
        scaler.wait(90)
        stats.stop()
        names = admin.admin_client(settings).list_topics(timeout=10).topics
        admin.delete_topics(settings, [n for n in names if n.startswith(settings.topic_prefix)])
    entries = [json.loads(line) for line in decisions.read_text().splitlines()]
    lines = [line.split() for line in journal.read_text().splitlines()] if journal.exists() else []
    return {"ok": ok, "clear_s": clear_s, "scaledown_s": scaledown_s, "decisions": entries,
            "starts": [w[1] for w in lines if w[0] == "start"], "ends": [w[1] for w in lines if w[0] == "end"],
            "jobs_by_worker": jobs_by_worker(lines), "peak_workers_observed": peak_workers_observed(lines),
            "peak_workers_decided": max(e["decision"]["chosen"] for e in entries),
            "audit": Autoscaler.audit(entries)}


def jobs_by_worker(journal: list[list[str]]) -> dict[str, int]:
    """Jobs each worker ran to the end, from the sleep journal's ``end <request> <worker> ...`` lines."""
    counts: dict[str, int] = {}
    for event, _request, worker, *_ in journal:
        if event == "end":
            counts[worker] = counts.get(worker, 0) + 1
    return counts


def peak_workers_observed(journal: list[list[str]]) -> int:
    """The most workers that had a job running at the same moment, from the journal (what ran, not what the
    autoscaler decided): each job is an interval from its ``start`` to its ``end`` line."""
    started: dict[tuple[str, str], float] = {}
    events: list[tuple[float, int, str]] = []
    for event, request, worker, _attempt, at in journal:
        if event == "start":
            started[(request, worker)] = float(at)
        elif event == "end" and (request, worker) in started:
            events += [(started.pop((request, worker)), 1, worker), (float(at), -1, worker)]
    busy: dict[str, int] = {}
    peak = 0
    for _at, delta, worker in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at one instant
        busy[worker] = busy.get(worker, 0) + delta
        peak = max(peak, sum(1 for n in busy.values() if n > 0))
    return peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--job-s", type=float, default=1.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--tick-s", type=float, default=10.0)
    parser.add_argument("--goal-minutes", type=float, default=1.0)
    parser.add_argument("--max-workers", type=int, default=8)
    parser.add_argument("--baseline", action="store_true", help="Also run the spike on one worker (measured).")
    args = parser.parse_args()
    cfg = SimConfig()
    seed, cpu = simulate(cfg, seed_rule=True), simulate(cfg, seed_rule=False)
    metrics = {"sim_scaleup_1_to_100_s": seed["scaleup_1_to_100_s"], "sim_queue_clear_s": seed["queue_clear_s"],
               "sim_cpu_only_queue_clear_s": cpu["queue_clear_s"], "sim_cpu_only_peak_pods": cpu["peak_pods"],
               "sim_spike_jobs": seed["spike_jobs"]}
    if not math.isnan(cpu["scaleup_1_to_100_s"]):  # the CPU trigger alone rarely gets there before the queue clears
        metrics["sim_cpu_only_scaleup_1_to_100_s"] = cpu["scaleup_1_to_100_s"]
    if not args.skip_local:
        if args.baseline:  # the same spike with the autoscaler capped at one worker: what not scaling costs here
            with tempfile.TemporaryDirectory() as tmp:
                fixed = local_run(broker(), Path(tmp), jobs=args.jobs, job_s=args.job_s, slots=args.slots,
                                  tick_s=args.tick_s, goal_minutes=args.goal_minutes, max_workers=1)
            metrics["local_one_worker_queue_clear_s"] = fixed["clear_s"]
        with tempfile.TemporaryDirectory() as tmp:
            run = local_run(broker(), Path(tmp), jobs=args.jobs, job_s=args.job_s, slots=args.slots,
                            tick_s=args.tick_s, goal_minutes=args.goal_minutes, max_workers=args.max_workers)
        metrics |= {"local_queue_clear_s": run["clear_s"],
                    # observed: workers with a job running at once (journal); decided: the autoscaler's largest ask
                    "local_peak_workers": float(run["peak_workers_observed"]),
                    "local_peak_workers_decided": float(run["peak_workers_decided"]),
                    "local_workers_that_ran_jobs": float(len(run["jobs_by_worker"])),
                    "local_scaledown_s": run["scaledown_s"], "local_lost_jobs": float(args.jobs - len(run["ok"])),
                    "local_jobs_run_twice": float(len(run["starts"]) - len(set(run["starts"]))),
                    "local_decisions_not_recomputable": float(len(run["audit"]))}
    report("autoscaling", metrics)


if __name__ == "__main__":
    main()
