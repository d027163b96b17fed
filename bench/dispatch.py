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
started: its pid file), the worker and this process (the client) spent over kiln's peak runs, per job.
Usage: python bench/dispatch.py [--jobs N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from pathlib import Path

from bench.common import broker, fresh_topics, offer_at_rate, percentile, report
from bench.raw_echo import RawEchoServer, round_trips
from kiln.schemas.builtin import EchoRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings

IN_FLIGHT = 5000


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_pid(settings: KilnSettings) -> int | None:
    """The local broker's pid (``infra/kafka/kafka.sh`` keeps it under the cache), None for any other broker."""
    port = settings.bootstrap_servers.rsplit(":", 1)[-1]
    pidfile = settings.cache / "run" / f"kafka-{port}" / "kafka.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().strip())
        cpu_seconds(pid)
        return pid
    return None


async def main(jobs: int) -> None:
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
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                kiln.append(await peak(client, topic, jobs))
                for name, pid in pids.items():
                    cpu[name] += cpu_seconds(pid) - before[name]
            rate = max(kiln)
            latencies = await paced(client, topic, rate / 2, 10.0)
    finally:
        worker.stop()
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
        **{f"dispatch_cpu_us_per_job_{name}": seconds / (jobs * len(kiln)) * 1e6 for name, seconds in cpu.items()},
    }, {"cores": str(cores), "latency samples": str(len(latencies)), "stretch goal": "25,000 jobs/s per core",
        "runs (jobs/s)": f"kiln {', '.join(f'{r:.0f}' for r in kiln)}; raw {', '.join(f'{r:.0f}' for r in raw)}; "
                         f"raw after delivery {', '.join(f'{r:.0f}' for r in raw_delivery)}"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    asyncio.run(main(parser.parse_args().jobs))
