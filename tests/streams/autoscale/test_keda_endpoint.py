"""``kiln autoscale run --backend keda`` serves the minimum where KEDA's metrics-api trigger reads it
(``valueLocation: desired``), computed from the stats stream with zero workers running."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kiln.schemas.builtin import SleepRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import StatsProcess, free_port
from kiln.streams.settings import KilnSettings


async def _submit(settings: KilnSettings, n: int) -> None:
    async with KilnClient(settings) as client:
        for i in range(n):
            await client.submit("sleep", SleepRequest(seconds=1, tag=f"k{i}"))


def test_keda_reads_the_cold_start_minimum(ops_topics: Callable[..., KilnSettings],
                                           stats_process: Callable[..., StatsProcess], tmp_path: Path) -> None:
    settings = ops_topics(("sleep.requests", 2))
    stats = stats_process(settings)
    asyncio.run(_submit(settings, 50))
    stats.wait("sleep", lambda s: s["queue_length"] == 50)
    port = free_port()
    scaler = subprocess.Popen(
        [sys.executable, "-m", "kiln.streams.cli", "autoscale", "run", "sleep", "--backend", "keda", "--stats-url",
         stats.url, "--tick-s", "1", "--goal-minutes", "5", "--slots-of", "sleep=2", "--job-seconds-guess", "60",
         "--port", str(port)], stdout=(tmp_path / "scaler.log").open("w"), stderr=subprocess.STDOUT)
    try:
        deadline, answer = time.monotonic() + 30, None
        while time.monotonic() < deadline and answer is None:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/keda/sleep", timeout=2)
                answer = response.json() if response.status_code == 200 else None
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # cold start: 50 jobs x 60 s guessed / 300 s goal = 10 slots, 2 per pod
        assert answer == {"stage": "sleep", "desired": 5, "branch": "cold-start"}, (tmp_path / "scaler.log").read_text()
        assert "kiln_autoscale_desired_workers" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    finally:
        scaler.terminate()
        scaler.wait(30)
