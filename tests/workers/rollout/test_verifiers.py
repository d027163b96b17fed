"""Verifiers through kiln's own stages: the exec stage checks a whole group with one command in a pooled sandbox
session, the Lean stage (fake REPL) tries every sample on one elaborated goal; a checker that fails or miscounts, a
task whose check is unreadable and an unknown verifier are routine errors with their reason; and a rollout worker
gets its rewards from the exec stage end to end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.rl.tasks import Addition, Propositions, exact_match
from kiln.schemas.exec import ExecRequest
from kiln.schemas.rl import RolloutGroup, RolloutRequest, RolloutTask, Sampling
from kiln.streams.client import KilnClient
from kiln.streams.codec import decode_request, request_payload
from kiln.streams.errors import RoutineJobError
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.verifiers import VerifierContext, Verifiers
from tests.conftest import _ensure
from tests.streams.harness import read_all
from tests.workers.exec.conftest import exec_worker
from tests.workers.lean.conftest import lean_worker
from tests.workers.rollout.actors import rollout_with_exec

pytestmark = pytest.mark.docker


async def test_exec_and_lean_verifiers(stage_topics: Callable[..., KilnSettings], project_image: str,
                                       tmp_path: Path, unique: str) -> None:
    _ensure("lean")
    settings = stage_topics(("exec.requests", 2), ("lean.requests", 2))
    with exec_worker(settings, tmp_path / "locks") as ex, lean_worker(settings, 2, free_port()) as lean:
        ex.wait_assigned()
        lean.wait_assigned()
        async with KilnClient(settings, f"verifier-{unique}") as kiln:
            verifiers = Verifiers(VerifierContext(kiln, exec_calls=1))
            task = Addition(exec_image=project_image).task(3, 4)
            completions = ["7", "8", " 7\n", "77", "x7"]
            for i in range(3):
                verdicts = await verifiers.get("exec").verify(task, completions, f"group-{i}")
                assert [v.reward for v in verdicts] == [exact_match(task, c) for c in completions] == [1, 0, 1, 0, 0]
                assert [v.details["said"] for v in verdicts] == ["7", "8", "7", "77", None]

            # Larger than a command line: the group travels as a file of the call.
            large = await verifiers.get("exec").verify(task, ["7" + " " * 9_999, "8" + " " * 9_999] * 4, "large")
            assert [v.reward for v in large] == [1, 0] * 4

            def broken(command: str) -> RolloutTask:
                return task.model_copy(update={"check": {**task.check, "command": command}})

            with pytest.raises(RoutineJobError, match="exited 3"):
                await verifiers.get("exec").verify(broken("exit 3"), completions, "failing")
            with pytest.raises(RoutineJobError, match="1 verdicts for 5"):
                await verifiers.get("exec").verify(broken("echo '{\"verdicts\": [{\"reward\": 1}]}'"), completions,
                                                   "miscounting")
            # Groups verified at once share one command and one checker; a group the checker refuses fails alone.
            together = [task] * 5 + [task.model_copy(update={"prompt": "x+y="})]
            outcomes = await asyncio.gather(*(verifiers.get("exec").verify(t, completions, f"together-{i}")
                                              for i, t in enumerate(together)), return_exceptions=True)
            assert [[v.reward for v in o] for o in outcomes[:5]] == [[1, 0, 1, 0, 0]] * 5  # type: ignore[union-attr]
            assert isinstance(outcomes[5], RoutineJobError) and "not an addition" in str(outcomes[5])
            isolated = task.model_copy(update={"check": {**task.check, "isolate": True}})
            assert [v.reward for v in await verifiers.get("exec").verify(isolated, completions, "alone")] == \
                [1, 0, 1, 0, 0]
            with pytest.raises(RoutineJobError, match="check for 'exec' is invalid"):
                await verifiers.get("exec").verify(task.model_copy(update={"check": {}}), completions, "unreadable")
            with pytest.raises(RoutineJobError, match="no verifier 'nope'"):
                verifiers.get("nope")

            goal = Propositions.task(0, "p \u2192 p \u2227 True")
            proofs = ["intro h; constructor; exact h; trivial", "intro h", "intro h; sorry", "exact nothing", ""]
            verdicts = await verifiers.get("lean").verify(goal, proofs, "lean-group")
            assert [v.reward for v in verdicts] == [1, 0, 0, 0, 0]
            assert "unknown identifier" in verdicts[3].details["error"]
            await verifiers.close()
    ops = [ExecRequest.model_validate(request_payload(decode_request(m.value()), ExecRequest, None)).op
           for m in read_all(settings, settings.topic("exec.requests"))]
    # Eight one-shot calls: four good groups and two failing ones one by one, six groups at once in one, an
    # isolated group in one — no session to open or close.
    assert ops == ["run_once"] * 8, ops


async def test_rollout_rewards_come_from_the_exec_stage(stage_topics: Callable[..., KilnSettings],
                                                        project_image: str, tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("rollout.requests", 2), ("rollouts", 1), ("exec.requests", 2))
    tasks = Addition(exec_image=project_image)
    async with rollout_with_exec(settings, tmp_path, unique) as client:
        sampling = Sampling(n=8, max_tokens=3)
        groups: list[RolloutGroup] = [await client.call("rollout", RolloutRequest(task=t, sampling=sampling))
                                      for t in tasks.sample(3)]
    for group in groups:
        task = tasks.task(*(int(x) for x in group.task_id.split("-")[1:]))
        for sample in group.samples:
            assert sample.verifier["name"] == "exec" and "said" in sample.verifier
            assert len(sample.verifier["version"]) == 16  # stamped by the rollout stage's Verifiers
            assert sample.reward == exact_match(task, sample.text)
