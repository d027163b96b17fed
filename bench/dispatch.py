"""Dispatch overhead: no-op ``echo`` round trips client -> topic -> worker -> result topic -> client, against a
bare confluent-kafka echo loop (``bench/raw_echo.py``) in the same run.

Parameters: one worker process (``kiln worker echo``, 256 slots), 8 request partitions, the broker on this
machine (all of it shares the machine's cores). Peak: 20,000 jobs with up to 5,000 in flight, closed loop.
Latency: an open-loop run at half the peak rate for 10 s; p50/p99 from submit to result.
The baselines: the same message bytes (a kiln envelope of the no-op job and of its result), acks=all, idempotent
producers, zstd, 8 partitions, one echo process and the same bound on records in flight; linger and batching
tuned to their best. The bare loop auto-commits (a request may be committed before its reply is delivered); the
commit-after-delivery loop commits a request only once its reply is delivered, kiln's guarantee.
``dispatch_vs_raw_ratio`` = kiln's jobs/s ÷ the bare loop's, ``dispatch_vs_raw_delivery_ratio`` = kiln's ÷ the
commit-after-delivery loop's, all measured here, interleaved (raw, raw after delivery, kiln, and again) so a load
change on the machine hits each.
Per core divides by every core of the machine (broker, worker and client all run here). Where the time goes:
``dispatch_cpu_us_per_job_<process>``, the CPU time (user + system, from /proc) the broker (the local one kiln
started: its pid file), the worker and this process (the client) spent over kiln's peak runs, per job
(``_kiln``: the three together).

The same on the stages a trainer's jobs take, after the no-op (its workers stopped): the exec ``run_once`` path
(``--exec-jobs`` calls of a no-op command, ``true``, on the toolchain image) and the verify path (``--verify-requests``
requests, each a prompt's 8 completions checked by the default addition checker, ``bench/verify.py``'s batch), each a
closed loop of ``--stage-concurrency`` jobs in flight after a warm-up, one exec worker (its default slots) and one
verify worker on this machine: ``dispatch_<path>_jobs_per_s``, ``_errors`` and
``dispatch_<path>_cpu_us_per_job_<process>`` — the client, the broker, the worker (run_once; verify: its verify and
exec workers), the sandboxes (the runners' CPU cgroups) and Docker's daemons — counted by
``bench/reward_throughput.py``'s accounts (``Accounts``); ``_kiln`` is kiln's own share: client, broker and workers.
Usage: python bench/dispatch.py [--jobs N] [--exec-jobs N] [--verify-requests N] [--stage-concurrency N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.common import broker, console, fresh_topics, offer_at_rate, percentile, report
from bench.raw_echo import RawEchoServer, round_trips
from bench.reward_throughput import Accounts, Phase, per_call, proc_cpu
from bench.verify import IMAGE, batch
from kiln.schemas.builtin import EchoRequest
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.common.containers import docker_client
from kiln.workers.exec.client import ExecClient
from kiln.workers.verifiers import exact_match
from kiln.workers.verify.client import VerifyClient

IN_FLIGHT = 5000
SAMPLES = 8  # completions per verify request (a prompt's group)


async def peak(client: KilnClient, topic: str, jobs: int) -> float:
    payload = EchoRequest(data=None)
    started = time.monotonic()
    futures = [await client.submit("echo", payload, topic=topic) for _ in range(jobs)]
    await asyncio.gather(*futures)
    return jobs / (time.monotonic() - started)


async def paced(client: KilnClient, topic: str, rate: float, seconds: float) -> list[float]:
    latencies: list[float] = []
    payload = EchoRequest(data=None)

    async def one(_n: int) -> None:
        t0 = time.monotonic()
        await (await client.submit("echo", payload, topic=topic))
        latencies.append((time.monotonic() - t0) * 1000)

    await offer_at_rate(rate, seconds, one)
    return latencies


def raw_rates(settings: KilnSettings, jobs: int, runs: int, after_delivery: bool) -> list[float]:
    requests, results = fresh_topics(settings, "raw-echo", 8)
    server = RawEchoServer(settings, requests, results, after_delivery)
    try:
        round_trips(settings, requests, results, 500, IN_FLIGHT)  # warm-up, as for kiln
        return [round_trips(settings, requests, results, jobs, IN_FLIGHT) for _ in range(runs)]
    finally:
        server.stop()


def broker_pid(settings: KilnSettings) -> int | None:
    """The local broker's pid (``infra/kafka/kafka.sh`` keeps it under the cache), None for any other broker."""
    port = settings.bootstrap_servers.rsplit(":", 1)[-1]
    pidfile = settings.cache / "run" / f"kafka-{port}" / "kafka.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().strip())
        if Path(f"/proc/{pid}").exists():
            return pid
    return None


Job = Callable[[int], Awaitable[str | None]]  # None: the right answer, else what went wrong


async def staged(accounts: Accounts, workers: dict[str, int], name: str, job: Job, jobs: int,
                 concurrency: int) -> dict[str, float]:
    """``jobs`` of ``job`` in a closed loop after a warm-up; jobs/s, errors and CPU microseconds per job by
    process (``workers``: extra worker processes by name, beside the accounts' own worker)."""
    await per_call(job)(0, min(jobs, concurrency), concurrency, Phase(), lambda _: None)  # warm runners, connections
    await asyncio.to_thread(accounts.drain)

    def snapshot() -> dict[str, float]:
        return {**accounts.snapshot(), **{w: proc_cpu(pid) for w, pid in workers.items()}}

    before, phase, started = await asyncio.to_thread(snapshot), Phase(), time.perf_counter()
    await per_call(job)(1_000_000, jobs, concurrency, phase, lambda _: None)
    phase.seconds = time.perf_counter() - started
    after = await asyncio.to_thread(snapshot)
    parts = ["client", *(workers or {"worker": 0}), "broker", "sandboxes", "docker"]
    spent = {part: (after[part] - before[part]) / jobs * 1e6 for part in parts}
    console.print(f"{name}: {phase.rate:.1f} jobs/s, {phase.errors} errors {' | '.join(phase.first_errors)}")
    return {f"dispatch_{name}_jobs_per_s": phase.rate, f"dispatch_{name}_errors": phase.errors,
            **{f"dispatch_{name}_cpu_us_per_job_{part}": us for part, us in spent.items()},
            f"dispatch_{name}_cpu_us_per_job_kiln": sum(us for part, us in spent.items()
                                                         if part not in ("sandboxes", "docker"))}


async def stage_paths(settings: KilnSettings, args: argparse.Namespace) -> dict[str, float]:
    """The exec run_once path and the verify path on real workers, CPU per job by process."""
    run_steps(COMPONENT_STEPS["docker"])
    settings = settings.model_copy(update={"topic_prefix": f"bench-dispatch-{uuid.uuid4().hex[:8]}."})
    names = ("exec.requests", "verify.requests")
    topics = [TopicSpec("kiln.results", 4), *(TopicSpec(n, 8) for n in names),
              *(TopicSpec(f"{n}.dlq", 1) for n in names)]
    admin.create_topics(settings, topics)
    tasks, completions = batch(args.verify_requests, SAMPLES, seed=0)
    groups = [(tasks[i], completions[i:i + SAMPLES]) for i in range(0, len(tasks), SAMPLES)]
    try:
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-bench-dispatch-")))
            env = {k: v for k, v in os.environ.items() if k != "KILN_SLOTS"}  # the exec worker picks its slots
            env.update({"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache)})
            metrics_port = free_port()
            ex = stack.enter_context(WorkerProcess("exec", settings, "exec.requests", slots=0, env={
                **env, "KILN_EXEC_LOCK_DIR": str(tmp / "locks"), "KILN_METRICS_PORT": str(metrics_port)}))
            ver = stack.enter_context(WorkerProcess("verify", settings, "verify.requests", slots=64, env={
                **env, "KILN_METRICS_PORT": str(free_port())}))
            ex.wait_assigned(120)
            ver.wait_assigned(120)
            accounts = Accounts(docker_client(), metrics_port, ex.proc.pid, None, tmp / "locks", [],
                                settings.bootstrap_servers.rsplit(":", 1)[1])
            async with KilnClient(settings, f"bench-dispatch-{uuid.uuid4().hex[:6]}") as kiln:
                exec_client, verify_client = ExecClient(kiln), VerifyClient(kiln)

                async def run_once(_n: int) -> str | None:
                    result = await exec_client.run_once(IMAGE, "true")
                    return None if result.output is not None and result.output.exit_code == 0 else f"{result.output}"

                async def verify(n: int) -> str | None:
                    task, group = groups[n % len(groups)]
                    verdicts = await verify_client.verify(task, group)
                    wrong = [v for v, c in zip(verdicts, group, strict=True) if v.reward != exact_match(task, c)]
                    return f"{len(wrong)} wrong verdicts: {wrong[0]}" if wrong else None

                c = args.stage_concurrency
                return {**await staged(accounts, {}, "runonce", run_once, args.exec_jobs, c),
                        **await staged(accounts, {"verify_worker": ver.proc.pid, "exec_worker": ex.proc.pid},
                                       "verify", verify, args.verify_requests, c)}
    finally:
        admin.delete_topics(settings, [settings.topic(t.name) for t in topics])


async def main(args: argparse.Namespace) -> None:
    jobs = args.jobs
    settings = broker()
    topic, results = fresh_topics(settings, "dispatch", 8)
    worker = WorkerProcess("echo", settings, topic, slots=256)
    raw: list[float] = []
    raw_delivery: list[float] = []
    kiln: list[float] = []
    found = {"worker": worker.proc.pid, "client": os.getpid(), "broker": broker_pid(settings)}
    pids = {name: pid for name, pid in found.items() if pid is not None}
    cpu: dict[str, float] = dict.fromkeys(pids, 0.0)
    try:
        worker.wait_assigned()
        async with KilnClient(settings, results_topic=results, max_in_flight=IN_FLIGHT, key_spread=8) as client:
            await peak(client, topic, 500)  # warm-up: connections, metadata, JIT-free but cache-warm
            for _ in range(2):
                raw += await asyncio.to_thread(raw_rates, settings, jobs, 1, False)
                raw_delivery += await asyncio.to_thread(raw_rates, settings, jobs, 1, True)
                before = {name: proc_cpu(pid) for name, pid in pids.items()}
                kiln.append(await peak(client, topic, jobs))
                for name, pid in pids.items():
                    cpu[name] += proc_cpu(pid) - before[name]
            rate = max(kiln)
            latencies = await paced(client, topic, rate / 2, 10.0)
    finally:
        worker.stop()
    per_job = {name: seconds / (jobs * len(kiln)) * 1e6 for name, seconds in cpu.items()}
    stages = await stage_paths(settings, args) if not args.no_stages else {}
    cores = os.cpu_count() or 1
    report("dispatch (no-op round trips, broker included)", {
        "dispatch_vs_raw_ratio": max(kiln) / max(raw),
        "dispatch_vs_raw_delivery_ratio": max(kiln) / max(raw_delivery),
        "dispatch_raw_jobs_per_s": max(raw),
        "dispatch_raw_jobs_per_s_per_core": max(raw) / cores,
        "dispatch_raw_delivery_jobs_per_s": max(raw_delivery),
        "dispatch_jobs_per_s": rate,
        "dispatch_jobs_per_s_per_core": rate / cores,
        "dispatch_p50_ms": percentile(latencies, 0.50),
        "dispatch_p99_ms": percentile(latencies, 0.99),
        **{f"dispatch_cpu_us_per_job_{name}": us for name, us in per_job.items()},
        "dispatch_cpu_us_per_job_kiln": sum(per_job.values()),
        **stages,
    }, {"cores": str(cores), "latency samples": str(len(latencies)), "stretch goal": "25,000 jobs/s per core",
        "runs (jobs/s)": f"kiln {', '.join(f'{r:.0f}' for r in kiln)}; raw {', '.join(f'{r:.0f}' for r in raw)}; "
                         f"raw after delivery {', '.join(f'{r:.0f}' for r in raw_delivery)}"})


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--exec-jobs", type=int, default=384, help="run_once calls measured")
    parser.add_argument("--verify-requests", type=int, default=256, help="verify requests measured")
    parser.add_argument("--stage-concurrency", type=int, default=64, help="run_once / verify jobs in flight")
    parser.add_argument("--no-stages", action="store_true", help="the no-op echo and its baselines only")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
