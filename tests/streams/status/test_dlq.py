"""``kiln dlq``: dead letters listed by reason and shown; a re-drive after the cause is fixed runs each job once
under a new request id naming the original, the owning client receives it through ``unclaimed()``, and a second
re-drive of the same records does nothing. ``kiln tail`` finds the re-driven request by the original id."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kiln.schemas.builtin import SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from tests.streams.harness import journal_events, read_all

CLIENT = "trainer-7"


def kiln(settings: KilnSettings, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kiln.streams.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "KILN_TOPIC_PREFIX": settings.topic_prefix, "COLUMNS": "200"},
                          timeout=120, check=True).stdout


async def _submit(settings: KilnSettings, requests: list[SleepRequest]) -> list[ResultEnvelope]:
    async with KilnClient(settings, CLIENT) as client:
        futures = [await client.submit("sleep", r) for r in requests]
        return list(await asyncio.gather(*futures))


async def _unclaimed(settings: KilnSettings, n: int) -> list[ResultEnvelope]:
    async with KilnClient(settings, CLIENT) as client:
        found: list[ResultEnvelope] = []
        async for result in client.unclaimed():
            found.append(result)
            if len(found) == n:
                return found
    return found


def test_redrive_runs_once_and_reaches_the_owner(ops_topics: Callable[..., KilnSettings], tmp_path: Path) -> None:
    settings = ops_topics(("sleep.requests", 2))
    journal = tmp_path / "journal"
    env = {"KILN_TOPIC_PREFIX": settings.topic_prefix}
    with WorkerProcess("sleep", settings, "sleep.requests", slots=2, journal=journal,
                       env={**env, "KILN_SLEEP_POISON_TAGS": '["poison"]'}) as broken:
        broken.wait_assigned()
        results = asyncio.run(_submit(settings, [SleepRequest(tag="poison"), SleepRequest(tag="poison"),
                                                 SleepRequest(tag="fine")]))
        broken.stop()  # graceful: its final commit keeps the fixed worker from replaying these three
    poisoned = sorted(r.request_id for r in results if r.status == "error")
    assert len(poisoned) == 2 and all(r.error and r.error.type == "PermanentJobError" for r in results
                                      if r.status == "error")
    read_all(settings, settings.topic("sleep.requests.dlq"), expect=2)

    listing = kiln(settings, "dlq", "ls", "--stage", "sleep", "--records")
    assert "PermanentJobError" in listing and all(rid in listing for rid in poisoned)
    shown = kiln(settings, "dlq", "show", "0", "--stage", "sleep")
    assert "kiln-error-type" in shown and "KILN_SLEEP_POISON_TAGS" in shown and '"tag": "poison"' in shown

    # The fix: a worker without the defect. Then the re-drive.
    with WorkerProcess("sleep", settings, "sleep.requests", slots=2, journal=journal, env=env) as fixed:
        fixed.wait_assigned()
        out = kiln(settings, "dlq", "redrive", "--stage", "sleep", "--reason", "PermanentJobError")
        assert "re-drove 2 of 2" in out, out
        redriven = asyncio.run(asyncio.wait_for(_unclaimed(settings, 2), 60))
        assert sorted(r.redriven_from or "" for r in redriven) == poisoned
        assert all(r.status == "ok" and r.client_id == CLIENT and r.request_id not in poisoned for r in redriven)

        again = kiln(settings, "dlq", "redrive", "--stage", "sleep", "--all")
        assert "re-drove 0 of 2" in again and again.count("already re-driven") == 2, again
        time.sleep(3)  # anything a second redrive had sent would have run by now on the idle worker
    ended = [rid for event, rid, _ in journal_events(journal) if event == "end"]
    assert sorted(rid for rid in ended if rid.startswith("redrive-")) == sorted(r.request_id for r in redriven)
    assert "re-driven" in kiln(settings, "dlq", "ls", "--stage", "sleep")

    tailed = kiln(settings, "tail", "sleep.requests", "--from-beginning", "--request-id", poisoned[0], "--json")
    records = [json.loads(line) for line in tailed.splitlines()]
    assert [r["value"]["redriven_from"] for r in records if r["value"].get("redriven_from")] == [poisoned[0]]
    results_tail = kiln(settings, "tail", "kiln.results", "--client", CLIENT, "-n", "50")
    assert results_tail.count("status=ok") == 3 and results_tail.count("status=error") == 2
