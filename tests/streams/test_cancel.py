"""A job the runtime gives up does not keep running beside its retry or its partition's next owner: the handler's
thread is cancelled and waited for first (``streams/cancel.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kiln.schemas.builtin import SleepRequest
from kiln.streams.cancel import CancelToken
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings


def _journal(path: Path) -> list[tuple[str, int, float]]:
    """(event, attempt, time) per journal line, in time order."""
    rows = [line.split() for line in path.read_text().splitlines()]
    return sorted(((r[0], int(r[3]), float(r[4])) for r in rows), key=lambda row: row[2])


async def test_timed_out_attempts_never_overlap_their_retry(kafka: KilnSettings, topics, unique: str,  # type: ignore[no-untyped-def]
                                                            tmp_path: Path) -> None:
    request_topic, results = topics(partitions=1)
    journal = tmp_path / "journal"
    with WorkerProcess("sleep", kafka, request_topic, slots=2, journal=journal,
                       env={"KILN_JOB_TIMEOUT_S": "1"}) as worker:
        worker.wait_assigned()
        async with KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
            with pytest.raises(RequestFailed, match="exceeded 1s"):
                await asyncio.wait_for(client.call("sleep", SleepRequest(seconds=30, mode="spin"),
                                                   topic=request_topic), 60)
    events = _journal(journal)
    assert [(e, a) for e, a, _ in events] == [("start", 1), ("stopped", 1), ("start", 2), ("stopped", 2),
                                              ("start", 3), ("stopped", 3)], events
    assert events[1][2] - events[0][2] < 5  # the spinning thread stopped at the timeout, not after 30 s


async def test_a_cancelled_caller_waits_for_its_thread_and_runs_cleanups() -> None:
    token = CancelToken()
    cleaned: list[str] = []
    token.on_cancel(lambda: cleaned.append("container killed"))
    finished: list[str] = []

    def blocking() -> None:
        token.cancelled.wait(10)
        finished.append("thread returned")

    task = asyncio.create_task(token.run(blocking))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["container killed"] and finished == ["thread returned"]
    token.on_cancel(lambda: cleaned.append("late"))  # registered after the cancel: runs at once
    assert cleaned[-1] == "late"
