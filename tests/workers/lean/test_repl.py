"""The REPL wrapper, pool and session against the fake REPL as a real process: protocol, Lean errors as
results, timeouts, crashes, memory bound, recycling, malformed output, header reuse, state handles (replies
without export, re-derivation elsewhere and after a crash, export every N tactics), export/import."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.schemas.lean import LeanRequest, ProofStateRef, code_base
from kiln.workers.lean.errors import ReplCrashed, ReplMemoryExceeded, ReplProtocolError, ReplTimeout
from kiln.workers.lean.pool import ReplPool
from kiln.workers.lean.repl import Header, ReplLimits, ReplProcess
from kiln.workers.lean.session import LeanSession, StateCodec
from tests.workers.lean.fake import FAKE_COMMAND, THEOREMS


@contextlib.asynccontextmanager
async def open_session(tmp: Path, size: int = 2, export_every: int = 16, repl_ops: list[str] | None = None,
                       **limits: int) -> AsyncIterator[LeanSession]:
    counter = iter(range(10_000))

    def factory(header: Header) -> ReplProcess:
        return ReplProcess(shlex.split(FAKE_COMMAND), header, tmp / f"p{next(counter)}", ReplLimits(**limits))

    ops = repl_ops if repl_ops is not None else []
    session = LeanSession(ReplPool(factory, size=size), StateCodec(None), export_every,
                          lambda op, _seconds: ops.append(op) if op != "fence" else None)  # fences: their own test
    try:
        yield session
    finally:
        await session.pool.close()


def code(text: str, header: list[str] | None = None, timeout_s: float = 30) -> LeanRequest:
    return LeanRequest(op="run_code", code=text, header=header or [], timeout_s=timeout_s)


def tactic(state: ProofStateRef | None, text: str, timeout_s: float = 30) -> LeanRequest:
    return LeanRequest(op="run_tactic", state=state, tactic=text, timeout_s=timeout_s)


async def test_code_with_sorries_then_tactics(tmp_path: Path) -> None:
    async with open_session(tmp_path) as session:
        result = await session.run(code(THEOREMS), "k")
        assert result.ok and [s.goal for s in result.sorries] == ["⊢ p → p ∧ True", "⊢ q ∨ r → r ∨ q", "⊢ a = a"]
        assert all(s.state.affinity == "k" and s.state.code and not s.state.exported for s in result.sorries)
        first = result.sorries[0].state
        step = await session.run(tactic(first, "intro h"), "k")
        assert step.ok and step.goals == ["h : p\n⊢ p ∧ True"] and step.proof_status == "Incomplete: open goals remain"
        assert step.state_pinned  # the same process still held the state
        assert step.state is not None
        done = await session.run(tactic(step.state, "constructor; exact h; trivial"), "k")
        assert done.completed and done.goals == []
        # Lean errors are results, not failures.
        bad = await session.run(tactic(first, "exact nothing"), "k")
        assert not bad.ok and "unknown identifier 'nothing'" in (bad.error or "")
        unknown = await session.run(tactic(first, "frobnicate"), "k")
        assert not unknown.ok and "unknown tactic" in (unknown.error or "")
        broken = await session.run(code("theorem x : p := by trivial\nnonsense here"), "k")
        assert not broken.ok and {m.severity for m in broken.messages} == {"error"}


async def test_headers_are_loaded_once_per_process_and_matter(tmp_path: Path) -> None:
    async with open_session(tmp_path) as session:
        mathlib = ["import Mathlib"]
        first = await session.run(code(THEOREMS, mathlib), "k")
        second = await session.run(code("import Mathlib\n" + THEOREMS), "k")  # header taken from the code
        assert not first.header_reused and second.header_reused
        assert (await session.run(tactic(first.sorries[2].state, "simp"), "k")).completed
        plain = await session.run(code(THEOREMS), "k")
        simp = await session.run(tactic(plain.sorries[2].state, "simp"), "k")
        assert not simp.ok and "unknown tactic 'simp'" in (simp.error or "")


async def test_export_in_one_process_import_in_another(tmp_path: Path) -> None:
    async with open_session(tmp_path / "a", export_every=1) as left, open_session(tmp_path / "b") as right:
        state = (await left.run(code(THEOREMS), "k")).sorries[1].state
        assert state.exported and state.raw_bytes > state.stored_bytes
        step = await right.run(tactic(state, "intro h; right"), "k")
        assert step.ok and not step.state_pinned and step.goals == ["h : q ∨ r\n⊢ q"]


async def test_handles_reply_without_export_and_export_every_n(tmp_path: Path) -> None:
    ops: list[str] = []
    async with open_session(tmp_path, export_every=3, repl_ops=ops) as session:
        state = (await session.run(code(THEOREMS), "k")).sorries[0].state
        for step_tactic, path_len in (("intro h", 1), ("constructor", 2)):
            step = await session.run(tactic(state, step_tactic), "k")
            assert step.state_pinned and step.state is not None and len(step.state.path) == path_len
            state = step.state
        assert ops == ["code", "tactic", "tactic"]  # no export, no replay: the states stayed live
        third = await session.run(tactic(state, "exact h"), "k")
        assert third.state is not None and third.state.exported and third.state.path == []
        assert ops[-2:] == ["tactic", "export"]
        # The exported state goes on from its pickle; a handle on it carries the pickle plus one tactic.
        last = await session.run(tactic(third.state, "trivial"), "k")
        assert last.completed and last.state is not None and last.state.data == third.state.data


async def test_a_handle_is_re_derived_in_another_process_and_after_a_crash(tmp_path: Path) -> None:
    ops: list[str] = []
    async with open_session(tmp_path / "a") as left, open_session(tmp_path / "b", size=1, repl_ops=ops) as right:
        state = (await left.run(code(THEOREMS), "k")).sorries[0].state
        for step_tactic in ("intro h", "constructor"):
            result = await left.run(tactic(state, step_tactic), "k")
            assert result.state is not None
            state = result.state
        moved = await right.run(tactic(state, "exact h"), "k")  # a process that never saw the state
        assert moved.ok and not moved.state_pinned and moved.goals == ["h : p\n⊢ True"]
        assert ops == ["replay", "replay", "replay", "tactic"]  # the command, then the two tactics of the path
        # The process holding everything crashes; the client's handles still work.
        with pytest.raises(ReplCrashed):
            await right.run(tactic(state, "fake_crash"), "k")
        assert moved.state is not None
        done = await right.run(tactic(moved.state, "trivial"), "k")
        assert done.completed and not done.state_pinned


async def test_requests_queue_for_the_process_holding_a_deep_state(tmp_path: Path) -> None:
    async with open_session(tmp_path, size=2) as session:
        state = (await session.run(code(THEOREMS), "k")).sorries[0].state
        for step_tactic in ("intro h", "constructor"):
            result = await session.run(tactic(state, step_tactic), "k")
            assert result.state is not None
            state = result.state
        # Re-deriving in a new process costs a start, the command and two tactics: three requests wait instead.
        three = await asyncio.gather(*(session.run(tactic(state, "fake_sleep 0.2; exact h"), "k")
                                       for _ in range(3)))
        assert all(r.state_pinned and r.goals == ["h : p\n⊢ True"] for r in three)
        assert session.pool.stats.spawned == 1
        # Past that a state moves: the queue would cost more than a new process re-deriving it (4 + 6 steps).
        many = await asyncio.gather(*(session.run(tactic(state, "fake_sleep 0.1; exact h"), "k")
                                      for _ in range(14)))
        assert all(r.goals == ["h : p\n⊢ True"] for r in many)
        assert not all(r.state_pinned for r in many) and session.pool.stats.spawned == 2


def test_a_handle_cannot_name_another_state() -> None:
    base = code_base([], THEOREMS, 0)
    ref = ProofStateRef(id=base, base=base, header=[], code=THEOREMS, goals=[])
    child = ref.then("intro h", [], "k")
    assert ProofStateRef.model_validate(child.model_dump()) == child
    with pytest.raises(ValidationError, match="id does not match"):
        ProofStateRef.model_validate({**child.model_dump(), "path": ["intro x"]})
    with pytest.raises(ValidationError, match="base does not match"):
        ProofStateRef.model_validate({**child.model_dump(), "code": THEOREMS + " "})
    with pytest.raises(ValidationError, match="exactly one"):
        ProofStateRef.model_validate({**child.model_dump(), "data": "AAAA"})


async def test_timeout_kills_and_respawns(tmp_path: Path) -> None:
    async with open_session(tmp_path) as session:
        state = (await session.run(code(THEOREMS), "k")).sorries[0].state
        with pytest.raises(ReplTimeout):
            await session.run(tactic(state, "fake_hang", timeout_s=0.5), "k")
        assert session.pool.stats.retired == {"timeout": 1}
        assert (await session.run(tactic(state, "intro h"), "k")).ok  # imported into a fresh process


async def test_crash_mid_request_is_typed_and_the_pool_recovers(tmp_path: Path) -> None:
    async with open_session(tmp_path) as session:
        state = (await session.run(code(THEOREMS), "k")).sorries[0].state
        with pytest.raises(ReplCrashed, match="exited mid-request"):
            await session.run(tactic(state, "fake_crash"), "k")
        with pytest.raises(ReplCrashed):
            await session.run(code("-- fake: crash\n" + THEOREMS), "k")
        assert session.pool.stats.retired == {"crash": 2}
        assert (await session.run(tactic(state, "intro h"), "k")).ok


async def test_memory_bound_is_enforced(tmp_path: Path) -> None:
    async with open_session(tmp_path, memory_bytes=200 << 20) as session:
        state = (await session.run(code(THEOREMS), "k")).sorries[0].state
        with pytest.raises(ReplMemoryExceeded):
            await session.run(tactic(state, "fake_grow 400; fake_sleep 5"), "k")
        assert session.pool.stats.retired == {"memory": 1}
        assert (await session.run(tactic(state, "intro h"), "k")).ok


async def test_processes_are_recycled_after_n_requests(tmp_path: Path) -> None:
    async with open_session(tmp_path, size=1, recycle_after=4) as session:
        state = (await session.run(code(THEOREMS), "k")).sorries[0].state
        for _ in range(9):  # three per process: the first request of each re-runs the state's command
            assert (await session.run(tactic(state, "intro h"), "k")).ok
        assert session.pool.stats.retired.get("recycled", 0) >= 2
        assert session.pool.stats.spawned >= 3


async def test_malformed_output_is_a_protocol_error(tmp_path: Path) -> None:
    async with open_session(tmp_path) as session:
        state = (await session.run(code(THEOREMS), "k")).sorries[0].state
        with pytest.raises(ReplProtocolError, match="not a reply"):
            await session.run(tactic(state, "fake_garbage"), "k")
        assert session.pool.stats.retired == {"protocol": 1}
        assert (await session.run(tactic(state, "intro h"), "k")).ok


async def test_a_full_pool_evicts_an_idle_process_of_another_header(tmp_path: Path) -> None:
    async with open_session(tmp_path, size=1) as session:
        await session.run(code(THEOREMS, ["import A"]), "k")
        await session.run(code(THEOREMS, ["import B"]), "k")
        assert session.pool.processes == 1 and session.pool.headers() == {("import B",): 1}


async def test_headers_count_processes_running_a_request(tmp_path: Path) -> None:
    """What the Lean stage reports in heartbeats (REPL processes per header) includes the busy ones."""
    async with open_session(tmp_path, size=2) as session:
        await session.run(code(THEOREMS, ["import A"]), "k")
        async with session.pool.lease(("import B",)):
            assert session.pool.headers() == {("import A",): 1}
            assert session.pool.headers(leased=True) == {("import A",): 1, ("import B",): 1}
        assert session.pool.headers() == {("import A",): 1, ("import B",): 1}
