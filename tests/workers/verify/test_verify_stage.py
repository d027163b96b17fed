"""The verify stage: one verdict per completion from a real sandboxed check — pass, fail, a checker past its time
(``timeout``), an unreadable task or an unknown verifier (``invalid_task``), a checker that fails
(``checker_error``) — never an error result; kiln's failures are retried within the client's budget (a checker past
its time keeps its failure after the retries: ``attempts``); a program's own failures (past its time, killed,
flooding its output, its process group killed, its stdout closed) are real 0s; a training step's batch is one
request, a failed group re-checked alone; and a verify worker SIGKILLed mid-batch costs only time: every request is
answered, each once, with the right verdicts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from kiln.schemas.envelope import ResultEnvelope
from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import VerifyRequest
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verify.client import VerifyClient, VerifySettings
from tests.workers.exec.conftest import exec_worker
from tests.workers.verify.conftest import task, timing_out, verify_worker

pytestmark = pytest.mark.docker


FAST = VerifySettings(retry_attempts=2, retry_backoff_s=0.05)


async def test_verdicts_and_typed_failures(stack: KilnSettings, unique: str) -> None:
    async with KilnClient(stack, f"verify-{unique}") as kiln:
        client = VerifyClient(kiln, FAST)
        verdicts = await client.verify(task(), ["7", "8", " 7\n"])
        assert [(v.reward, v.failure, v.details["said"]) for v in verdicts] == [
            (1.0, None, "7"), (0.0, None, "8"), (1.0, None, "7")]
        late, unreadable, unknown, failing = await asyncio.gather(
            client.verify(timing_out(), ["7", "8"]),
            client.verify(task().model_copy(update={"check": {"command": "x"}}), ["7"]),
            client.verify(task().model_copy(update={"verifier": "nope"}), ["7"]),
            client.verify(task(command="exit 3"), ["7"]))
        assert [(v.reward, v.failure, v.attempts) for v in late] == [(0.0, "timeout", 2)] * 2  # retried, no reward
        assert "past 1.0 s" in late[0].reason
        assert (unreadable[0].failure, unknown[0].failure, failing[0].failure) == (
            "invalid_task", "invalid_task", "checker_error")
        assert "no verifier 'nope'" in unknown[0].reason and "exited 3" in failing[0].reason
        # A step's batch (one request): completions of one task are a group, the order is the batch's; the group
        # kiln failed to judge is checked again alone (its second attempt), the others stand.
        tasks = [task("7"), task("5"), task("7"), timing_out()]
        batch = await client.verify_batch(tasks, ["7", "5", "6", "7"])
        assert [(v.reward, v.failure, v.attempts) for v in batch] == [
            (1.0, None, 1), (1.0, None, 1), (0.0, None, 1), (0.0, "timeout", 2)]


ATTACKS = {  # a program's own failures, each measured outside it: a real 0, never "no reward"
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(b'x' * (16 << 20))\n",
    "flood_after_answer": "import sys\nprint(7)\nsys.stdout.write('\\n' * (8 << 20))\n",
    "killpg": "import os, signal\nprint(7, flush=True)\nos.killpg(0, signal.SIGKILL)\n",
    "close_stdout": "import os\nos.close(1)\nprint(7)\n",
    # SIGKILL to every process it may signal (Linux spares the caller): the supervisor is not among them.
    "kill_everything": "import os, signal\nos.kill(-1, signal.SIGKILL)\n",
    # The work areas are memory (tmpfs): files filling the whole memory limit must not take the supervisor down.
    "fill_memory_with_files": "for i in range(4096):\n    with open(f'/tmp/f{i}', 'wb') as f:\n"
                              "        f.write(b'x' * (1 << 20))\nprint(7)\n",
}


async def test_a_programs_own_failures_are_real_zeros(stack: KilnSettings, unique: str) -> None:
    program = RolloutTask(task_id="seven", prompt="", verifier="program",
                          check={"expected_output": "7", "timeout_s": 10,  # wall time: a loaded machine is slow
                                 "limits": {"memory_mb": 256, "pids": 64, "cpus": 0.25}})
    async with KilnClient(stack, f"verify-{unique}") as kiln:
        verdicts = await VerifyClient(kiln, FAST).verify(program, ["print(7)", *ATTACKS.values()])
    assert (verdicts[0].reward, verdicts[0].failure) == (1.0, None)
    got = {name: (v.reward, v.failure, v.policy_failure) for name, v in zip(ATTACKS, verdicts[1:], strict=True)}
    assert all(reward == 0.0 and failure is None for reward, failure, _ in got.values()), got  # all real 0s
    # Which of its own failures a bomb meets first (the limit, or its time) depends on the machine's load.
    own = {name: kind for name, (_, _, kind) in got.items()}
    assert own["fork_bomb"] == "timeout" and own["memory_bomb"] in ("crashed", "timeout"), own
    assert own["fill_memory_with_files"] in ("crashed", "timeout") and own["flood_after_answer"] == "output_limit"
    assert (own["killpg"], own["close_stdout"], own["kill_everything"]) == ("crashed", "crashed", None), own


async def test_a_worker_killed_mid_batch_costs_only_time(verify_settings: KilnSettings, docker_engine: Any,
                                                         tmp_path: Path, unique: str) -> None:
    """16 requests whose checker takes 2 s; the verify worker holding them is killed while they run, a second one
    takes over: every request is answered once, with its verdicts."""
    slow = task(command="sleep 2; python3 -I check.py")
    with exec_worker(verify_settings, tmp_path / "locks") as ex:
        ex.wait_assigned()
        first = verify_worker(verify_settings, slots=16, KILN_VERIFY_EXEC_BATCH_GROUPS="1")
        first.wait_assigned()
        async with KilnClient(verify_settings, f"killed-{unique}") as kiln:
            futures = [await kiln.submit("verify", VerifyRequest(task=slow, completions=[str(i), "7"]))
                       for i in range(16)]
            await asyncio.sleep(1.5)  # every request taken, none answered yet (each takes ≥ 2 s)
            assert not any(f.done() for f in futures)
            first.kill()
            started = time.monotonic()
            with verify_worker(verify_settings, slots=16) as second:
                second.wait_assigned()
                envelopes: list[ResultEnvelope] = list(await asyncio.wait_for(asyncio.gather(*futures), 120))
            assert time.monotonic() - started < 90
            assert len({e.request_id for e in envelopes}) == 16
            for i, envelope in enumerate(envelopes):
                result = kiln.result_of(envelope)
                assert [v.reward for v in result.verdicts] == [1.0 if i == 7 else 0.0, 1.0], i
