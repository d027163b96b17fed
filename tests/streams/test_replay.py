"""``kiln replay``: a topic from offset 0 through a handler, re-emitting no results."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from kiln.schemas.builtin import SleepRequest
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import sleep
from tests.streams.harness import journal_events, read_all, running_worker


async def test_replay_from_beginning_runs_every_job_once_without_results(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                         unique: str, tmp_path: Path) -> None:
    request_topic, results = topics(partitions=3)
    async with running_worker(sleep.stage, kafka, request_topic, slots=4), \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        for i in range(25):
            await client.call("sleep", SleepRequest(tag=f"j{i}"), topic=request_topic)
    assert len(read_all(kafka, results, expect=25)) == 25

    journal = tmp_path / "journal"
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kiln.streams.cli", "replay", request_topic, "--from-beginning", "--stage", "sleep"],
        env={"KILN_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "KILN_SLEEP_JOURNAL": str(journal),
             "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "replayed 25 messages: 25 ok" in proc.stdout
    starts = [rid for ev, rid, w in journal_events(journal) if ev == "start"]
    assert len(starts) == 25 and len(set(starts)) == 25
    assert len(read_all(kafka, results, expect=25)) == 25  # no second round of results
