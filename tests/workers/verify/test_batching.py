"""The verify stage's batching window adapts, end to end (client, broker, verify worker, exec worker): with a window
of an hour and a quiet gap of 10 s, a lone request is answered in one exec call of its own without waiting for
either; a step's batch (a request per prompt, all in flight) shares calls of up to ``KILN_VERIFY_EXEC_BATCH_GROUPS``
groups, none sent ahead alone (the requests say they were sent together). Every completion still gets its own
verdict."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verify.client import VerifyClient
from tests.workers.exec.conftest import exec_worker
from tests.workers.verify.conftest import call_sizes, task, verify_worker

pytestmark = pytest.mark.docker

QUIET_S = 10.0


async def test_a_lone_request_goes_at_once_and_a_flood_batches(verify_settings: KilnSettings, docker_engine: Any,
                                                               tmp_path: Path, unique: str) -> None:
    window = {"KILN_VERIFY_EXEC_BATCH_WINDOW_S": "3600", "KILN_VERIFY_EXEC_BATCH_QUIET_S": str(QUIET_S),
              "KILN_VERIFY_EXEC_BATCH_GROUPS": "8"}
    with exec_worker(verify_settings, tmp_path / "locks") as ex, \
            verify_worker(verify_settings, slots=32, **window) as ver:
        ex.wait_assigned()
        ver.wait_assigned()
        async with KilnClient(verify_settings, f"window-{unique}") as kiln:
            client = VerifyClient(kiln)
            # The runner warm, by another checker (a checker's batching remembers only its own recent groups).
            assert [v.reward for v in await client.verify(task(timeout_s=29), ["7"])] == [1.0]
            started = time.monotonic()
            lone = await client.verify(task(), ["7", "8", " 7\n"])
            took = time.monotonic() - started
            assert [v.reward for v in lone] == [1.0, 0.0, 1.0]
            assert took < QUIET_S, f"a lone request waited {took:.1f} s"  # neither the window nor the quiet gap
            assert call_sizes(verify_settings, 2) == [1, 1]

            # A step's batch: 16 prompts (distinct tasks, one checker: a third one) x 2 completions, a request per
            # prompt.
            answers = [str(n) for n in range(16)]
            tasks = [task(a, timeout_s=28) for a in answers for _ in range(2)]
            completions = [c for a in answers for c in (a, f"{a}0")]
            verdicts = await client.verify_batch(tasks, completions)
            assert [v.reward for v in verdicts] == [1.0, 0.0] * 16
            flood = call_sizes(verify_settings, 4)[2:]  # the two lone calls above sort first
            # Full batches go at once; the step's requests say they were sent together, so the first to reach the
            # worker waits for the others (however long the gaps between them) instead of going alone.
            assert flood == [8, 8], flood
