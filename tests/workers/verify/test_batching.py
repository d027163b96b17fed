"""The verify stage's batching window adapts, end to end (client, broker, verify worker, exec worker): with a window
of an hour and a quiet gap of 10 s, a lone request is answered in one exec call of its own without waiting for
either; a step's batch (its groups, one per prompt, in one request) shares calls of up to
``KILN_VERIFY_EXEC_BATCH_GROUPS`` groups, none sent ahead alone, and a step over ``STEP_COMPLETIONS`` travels as
requests that say they were sent together, batched the same. Every completion still gets its own verdict."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kiln.schemas.verify import VerifyRequest
from kiln.streams.client import KilnClient
from kiln.streams.codec import decode_request, request_payload
from kiln.streams.settings import KilnSettings
from kiln.workers.verify import client as verify_client
from kiln.workers.verify.client import VerifyClient
from tests.streams.harness import read_all
from tests.workers.exec.conftest import exec_worker
from tests.workers.verify.conftest import call_sizes, task, verify_worker

pytestmark = pytest.mark.docker

QUIET_S = 10.0


def groups_per_request(settings: KilnSettings, requests: int) -> list[int]:
    """Groups each request on ``verify.requests`` carried, once it holds at least ``requests``."""
    return sorted(len(VerifyRequest.model_validate(request_payload(decode_request(r.value()), VerifyRequest, None))
                      .each()) for r in read_all(settings, settings.topic("verify.requests"), expect=requests))


async def test_a_lone_request_goes_at_once_and_a_flood_batches(verify_settings: KilnSettings, docker_engine: Any,
                                                               tmp_path: Path, unique: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
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

            # A step's batch: 12 prompts (distinct tasks, one checker: a third one) x 2 completions, one request.
            answers = [str(n) for n in range(16)]
            tasks = [task(a, timeout_s=28) for a in answers[:12] for _ in range(2)]
            completions = [c for a in answers for c in (a, f"{a}0")]
            started = time.monotonic()
            verdicts = await client.verify_batch(tasks, completions[:24])
            took = time.monotonic() - started
            assert [v.reward for v in verdicts] == [1.0, 0.0] * 12
            assert groups_per_request(verify_settings, 3) == [1, 1, 12]
            # Full batches go at once, and so does the rest once the step's last group has joined: no quiet gap.
            assert call_sizes(verify_settings, 4) == [1, 1, 4, 8]
            assert took < QUIET_S, f"a step's batch waited {took:.1f} s"

            # A step over STEP_COMPLETIONS (here 12): requests of up to 12 completions, sent together; the first to
            # reach the worker waits for the others (however long the gaps between them) instead of going alone.
            monkeypatch.setattr(verify_client, "STEP_COMPLETIONS", 12)
            tasks = [task(a, timeout_s=27) for a in answers for _ in range(2)]
            verdicts = await client.verify_batch(tasks, completions)
            assert [v.reward for v in verdicts] == [1.0, 0.0] * 16
            assert groups_per_request(verify_settings, 6) == [1, 1, 4, 6, 6, 12]
            assert call_sizes(verify_settings, 6) == [1, 1, 4, 8, 8, 8]
