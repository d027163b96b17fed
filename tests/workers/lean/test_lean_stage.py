"""The ``lean`` stage on the real broker with the fake REPL in real worker processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kiln.schemas.lean import LeanRequest, ProofStateRef
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.lean.client import LeanClient
from tests.streams.harness import read_all
from tests.workers.lean.conftest import lean_worker
from tests.workers.lean.fake import THEOREMS


async def metrics(port: int) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{port}/metrics")).text


async def test_lean_requests_across_two_workers(stage_topics: Callable[..., KilnSettings]) -> None:
    settings = stage_topics(("lean.requests", 4))
    ports = [free_port(), free_port()]
    with lean_worker(settings, 2, ports[0]) as w1, lean_worker(settings, 2, ports[1]) as w2:
        w1.wait_assigned()
        w2.wait_assigned()
        async with KilnClient(settings, "prover") as kiln:
            client = LeanClient(kiln)
            code = await client.run_code(THEOREMS, key="session-1")
            assert code.ok and len(code.sorries) == 3
            state = code.sorries[0].state
            assert state.affinity == "session-1"
            step = await client.run_tactic(state, "intro h")
            assert step.ok and step.state_pinned and step.goals == ["h : p\n⊢ p ∧ True"]
            failed = await client.run_tactic(state, "exact nothing")
            assert not failed.ok and "unknown identifier" in (failed.error or "")

            # A handle made in one worker, re-derived in the other: route the state to the worker that did not make it.
            origin = (await (await kiln.submit("lean", LeanRequest(op="run_tactic", state=state, tactic="intro h"),
                                                 key=state.affinity))).worker
            for i in range(64):
                moved = state.model_copy(update={"affinity": f"elsewhere-{i}"})
                envelope = await (await kiln.submit("lean", LeanRequest(op="run_tactic", state=moved,
                                                                           tactic="intro h"), key=moved.affinity))
                if envelope.worker != origin:
                    break
            assert envelope.worker != origin, "no key reached the other worker"
            imported = kiln.result_of(envelope)
            assert imported.ok and not imported.state_pinned and imported.goals == ["h : p\n⊢ p ∧ True"]

            # 1,000 concurrent tactic requests from one client, each answered with its own result.
            results = await asyncio.gather(*(client.run_tactic(state, f"intro h{i}") for i in range(1000)))
            assert [r.goals for r in results] == [[f"h{i} : p\n⊢ p ∧ True"] for i in range(1000)]

            search = await client.explore(code.sorries[1].state, ["intro h", "left", "right", "cases h",
                                                                  "exact h", "assumption"], max_depth=3)
            # The fake calculus has no case analysis: the search must exhaust its depth without a proof.
            assert search.proof is None and search.depth == 3 and search.expanded >= 6 and search.lean_errors > 0
            search = await client.explore(state, ["intro h", "constructor", "exact h", "trivial"], max_depth=4)
            assert search.proof == ["intro h", "constructor", "exact h", "trivial"]
        text = await metrics(ports[0]) + await metrics(ports[1])
    assert 'kiln_lean_header_total{outcome="hit"}' in text
    assert "kiln_lean_state_compression_ratio_count" in text


async def test_misbehaving_repl_gives_typed_failures_and_the_worker_lives(
        stage_topics: Callable[..., KilnSettings], tmp_path: Path) -> None:
    settings = stage_topics(("lean.requests", 1))
    port = free_port()
    # The crash-once marker must outlive the REPL process: its folder is bound writable into every sandbox.
    with lean_worker(settings, 2, port, KILN_LEAN_MEMORY_MB="200", KILN_LEAN_RECYCLE_AFTER="6",
                     KILN_LEAN_SANDBOX_WRITABLE=json.dumps([str(tmp_path)])) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, "prover") as kiln:
            client = LeanClient(kiln)
            state: ProofStateRef = (await client.run_code(THEOREMS)).sorries[0].state
            with pytest.raises(RequestFailed, match="ReplTimeout"):
                await client.run_tactic(state, "fake_hang", timeout_s=1)
            with pytest.raises(RequestFailed, match="ReplMemoryExceeded"):
                await client.run_tactic(state, "fake_grow 400; fake_sleep 10")
            with pytest.raises(RequestFailed, match="ReplCrashed"):
                await client.run_tactic(state, "fake_crash")  # crashes on every attempt: a clear failure
            retried = await client.run_tactic(state, f"fake_crash_once {tmp_path / 'marker'}; intro h")
            assert retried.ok and retried.goals == ["h : p\n⊢ p ∧ True"]  # crashed once, retried, succeeded
            with pytest.raises(RequestFailed, match="ReplProtocolError"):
                await client.run_tactic(state, "fake_garbage")
            for _ in range(14):
                assert (await client.run_tactic(state, "intro h")).ok
        assert worker.proc.poll() is None
        text = await metrics(port)
    # A tactic past its time or memory is an answer; only what crashed on every attempt is dead-lettered.
    dead = read_all(settings, settings.topic("lean.requests.dlq"), expect=2)
    assert sorted(dict(m.headers())["kiln-error-type"] for m in dead) == [b"ReplCrashed", b"ReplProtocolError"]
    for reason in ("timeout", "memory", "crash", "protocol", "recycled"):
        assert f'kiln_lean_repl_retired_total{{reason="{reason}"}}' in text, reason


async def test_killed_worker_tactics_complete_elsewhere_once(stage_topics: Callable[..., KilnSettings]) -> None:
    settings = stage_topics(("lean.requests", 4))
    with lean_worker(settings, 2, free_port()) as doomed, lean_worker(settings, 2, free_port()) as survivor:
        doomed.wait_assigned()
        survivor.wait_assigned()
        async with KilnClient(settings, "prover") as kiln:
            client = LeanClient(kiln)
            state = (await client.run_code(THEOREMS)).sorries[0].state
            seen: list[str] = []
            some_done = asyncio.Event()

            async def one(i: int) -> None:
                moved = state.model_copy(update={"affinity": f"k{i % 16}"})  # spread over all partitions
                result = await client.run_tactic(moved, f"fake_sleep 0.1; intro h{i}")
                seen.append(result.goals[0].split(" :")[0])
                if len(seen) >= 10:
                    some_done.set()

            jobs = [asyncio.create_task(one(i)) for i in range(120)]
            await asyncio.wait_for(some_done.wait(), 120)
            doomed.kill()
            await asyncio.wait_for(asyncio.gather(*jobs), 240)
    assert sorted(seen) == sorted(f"h{i}" for i in range(120))  # every job, each result once
