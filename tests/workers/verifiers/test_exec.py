"""The ``exec`` verifier's batching window adapts to how groups arrive, on a real exec worker: a lone group goes at
once, however long the window; groups that keep coming (a flood) share calls — each batch full, or sent once they
pause; groups delivered together share one call; groups that come one by one while a call with their checker runs
(a steady stream) share one too. Every group still gets its own verdicts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.rl.tasks import Addition, exact_match
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verifiers import ExecVerifier, VerifierContext
from tests.workers.exec.conftest import exec_worker
from tests.workers.verify.conftest import call_sizes

pytestmark = pytest.mark.docker


async def test_the_window_adapts(stage_topics: Callable[..., KilnSettings], project_image: str, tmp_path: Path,
                                 unique: str) -> None:
    settings = stage_topics(("exec.requests", 2))
    task = Addition(exec_image=project_image).task(3, 4)
    completions = ["7", "8", " 7\n"]
    with exec_worker(settings, tmp_path / "locks") as ex:
        ex.wait_assigned()
        async with KilnClient(settings, f"batching-{unique}") as kiln:
            # A window of an hour: a lone group that waited for it would outlast the test's timeout.
            verifier = ExecVerifier(VerifierContext(kiln, exec_calls=4, exec_batch_groups=8, exec_batch_window_s=3600,
                                                    exec_batch_quiet_s=0.5))
            lone = await verifier.verify(task, completions, "lone")
            assert [v.reward for v in lone] == [exact_match(task, c) for c in completions] == [1, 0, 1]
            assert call_sizes(settings, 1) == [1]

            # A flood, 20 ms apart: its first group goes alone (nothing came before it), the others join batches
            # of 8 that go as they fill; the last, short one goes once the groups stop for the quiet gap.
            async def one(i: int) -> list[float]:
                await asyncio.sleep(0.02 * i)
                return [v.reward for v in await verifier.verify(task, completions, f"flood-{i}")]

            await asyncio.sleep(1)  # (the lone group's join has left the verifier's memory of a flood)
            assert await asyncio.gather(*(one(i) for i in range(20))) == [[1, 0, 1]] * 20
            assert call_sizes(settings, 5) == [1, 1, 3, 8, 8]

            # Delivered together (in one turn of the loop): one call, though nothing came just before.
            await asyncio.sleep(1)
            together = await asyncio.gather(*(verifier.verify(task, completions, f"together-{i}") for i in range(6)))
            assert [[v.reward for v in vs] for vs in together] == [[1, 0, 1]] * 6
            assert call_sizes(settings, 6) == [1, 1, 3, 6, 8, 8]

            # A steady stream: groups that come one by one, further apart than the quiet gap, while a call with
            # their checker (a slow one: 3 s) still runs join a batch rather than each going alone.
            await asyncio.sleep(1)
            slow = task.model_copy(update={"check": {**task.check, "command": f"sleep 3; {task.check['command']}"}})

            async def stream(i: int) -> list[float]:
                await asyncio.sleep((0, 0.8, 0.9)[i])
                return [v.reward for v in await verifier.verify(slow, completions, f"stream-{i}")]

            assert await asyncio.gather(*(stream(i) for i in range(3))) == [[1, 0, 1]] * 3
            assert call_sizes(settings, 8) == [1, 1, 1, 2, 3, 6, 8, 8]
            await verifier.close()
