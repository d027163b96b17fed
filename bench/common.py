"""Shared benchmark plumbing: the local broker, fresh topics, worker processes, METRIC lines and tables."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from kiln.streams import admin
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec

console = Console(stderr=True)
# Benches ingest scratch repositories they create under the temp dir; a deployment allows no local path.
os.environ.setdefault("KILN_INGEST_LOCAL_ROOTS", json.dumps([tempfile.gettempdir()]))


def broker() -> KilnSettings:
    run_steps(COMPONENT_STEPS["kafka"])
    settings = KilnSettings(bootstrap_servers=os.environ.get("KILN_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    admin.wait_for_broker(settings)
    return settings


def fresh_topics(settings: KilnSettings, name: str, partitions: int) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    request, results = f"bench-{name}-{tag}", f"bench-{name}-{tag}-results"
    admin.create_topics(settings, [TopicSpec(request, partitions), TopicSpec(f"{request}.dlq", 1),
                                   TopicSpec(results, 4)])
    return request, results


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(title: str, metrics: dict[str, float], notes: dict[str, str] | None = None) -> None:
    """``METRIC name value`` lines on stdout, and a readable table on stderr."""
    table = Table("metric", "value", title=title)
    for name, value in metrics.items():
        print(f"METRIC {name} {value:.6g}", flush=True)
        table.add_row(name, f"{value:.4g}")
    for name, note in (notes or {}).items():
        table.add_row(name, note)
    console.print(table)


async def until(condition: Callable[[], bool], what: str, timeout_s: float, interval_s: float = 0.2) -> float:
    """Poll ``condition`` (in a thread: it may block) until it holds; the seconds it took. ``RuntimeError`` when it
    still does not after ``timeout_s``."""
    start = time.monotonic()
    while not await asyncio.to_thread(condition):
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{what}: not after {timeout_s:g}s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start


async def offer_at_rate(rate: float, seconds: float, job: Callable[[int], Awaitable[None]]) -> None:
    """Open-loop load: start ``job(n)`` at ``rate`` per second for ``seconds``, whatever the completions do,
    then wait for all of them (latency is measured under the offered load, not throttled by it)."""
    tasks: list[asyncio.Task[None]] = []

    async def run(n: int) -> None:
        await job(n)

    start, n = time.monotonic(), 0
    while (now := time.monotonic()) - start < seconds:
        while n < int((now - start) * rate):
            tasks.append(asyncio.create_task(run(n)))
            n += 1
        await asyncio.sleep(0.001)
    await asyncio.gather(*tasks)


def learning_runs(record_dir: Path) -> KilnSettings:
    """Set up an RL bench: each run's evaluations and kills (``kiln.rl.run``) logged as its progress, the record
    directory made, the broker up."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    logging.getLogger("kiln.rl.run").setLevel(logging.INFO)
    record_dir.mkdir(parents=True, exist_ok=True)
    return broker()
