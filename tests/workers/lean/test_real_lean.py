"""The Lean stage's session against a real Lean REPL. Runs only where one is installed:
KILN_LEAN_REPL = the ``repl`` binary (leanprover-community/repl), KILN_LEAN_PROJECT = a Lake project directory
(its search path provides the imports). Lean cannot be installed on the CI machine, so there it skips."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.schemas.lean import LeanRequest
from kiln.workers.lean.pool import ReplPool
from kiln.workers.lean.repl import Header, ReplLimits, ReplProcess
from kiln.workers.lean.session import LeanSession, StateCodec
from kiln.workers.verifiers.lean import ALLOWED_AXIOMS, kernel_command, kernel_verdict, refusal
from tests.workers.verifiers.test_lean_kernel import ATTACKS

REPL = os.environ.get("KILN_LEAN_REPL")
PROJECT = os.environ.get("KILN_LEAN_PROJECT")
pytestmark = pytest.mark.skipif(
    not (REPL and PROJECT and shutil.which(shlex.split(REPL)[0]) and Path(PROJECT).is_dir()),
    reason="no real Lean REPL here (set KILN_LEAN_REPL and KILN_LEAN_PROJECT)")


async def _factory(tmp_path: Path) -> Callable[[Header], ReplProcess]:
    assert REPL and PROJECT
    lean_path = (await asyncio.to_thread(subprocess.run, ["lake", "env", "printenv", "LEAN_PATH"], cwd=PROJECT,
                                         capture_output=True, text=True, check=True)).stdout.strip()
    env = {**os.environ, "LEAN_PATH": lean_path}
    counter = iter(range(100))
    repl = shlex.split(REPL)

    def factory(header: Header) -> ReplProcess:
        return ReplProcess(repl, header, tmp_path / f"p{next(counter)}", ReplLimits(), cwd=Path(PROJECT), env=env)

    return factory


async def test_real_repl_runs_code_tactics_and_moves_states(tmp_path: Path) -> None:
    factory = await _factory(tmp_path)

    # ``one`` exports every state (a real pickle moves); ``two`` answers with handles (re-derived by ``one`` below).
    one = LeanSession(ReplPool(factory, 1), StateCodec(None), export_every=1)
    two = LeanSession(ReplPool(factory, 1), StateCodec(None))
    try:
        code = await one.run(LeanRequest(op="run_code", code="theorem t (p q : Prop) (hp : p) (hq : q) : p ∧ q := "
                                                              "by sorry", timeout_s=300), "k")
        assert code.ok and len(code.sorries) == 1
        state = code.sorries[0].state
        assert state.stored_bytes < state.raw_bytes
        bad = await two.run(LeanRequest(op="run_tactic", state=state, tactic="exact nonsense", timeout_s=120), "k")
        assert not bad.ok
        done = await two.run(LeanRequest(op="run_tactic", state=state, tactic="exact ⟨hp, hq⟩", timeout_s=120), "k")
        assert done.completed and not done.state_pinned  # imported into the second process
        handle = (await two.run(LeanRequest(op="run_code", code="theorem u (p : Prop) (hp : p) : p ∧ True := by sorry",
                                            timeout_s=300), "k")).sorries[0].state
        step = await two.run(LeanRequest(op="run_tactic", state=handle, tactic="constructor", timeout_s=120), "k")
        assert step.state is not None and not step.state.exported
        finished = await one.run(LeanRequest(op="run_tactic", state=step.state, tactic="exact hp; trivial",
                                             timeout_s=120), "k")
        assert finished.completed and not finished.state_pinned  # re-run and replayed in the first process
    finally:
        await one.pool.close()
        await two.pool.close()


async def test_the_real_kernel_judges_the_lean_verifiers_cases(tmp_path: Path) -> None:
    """tests/workers/verifiers/test_lean_kernel.py's cases on real Lean: an honest proof scores 1 by the kernel and its
    axiom report; ``sorry`` and ``native_decide`` (not allowed by default) score 0 by theirs; and every attack the
    verifier refuses before it runs also scores 0 when sent anyway (the refusal is not the only line)."""
    session = LeanSession(ReplPool(await _factory(tmp_path), 1), StateCodec(None))

    async def reward(statement: str, proof: str, allowed: tuple[str, ...] = ALLOWED_AXIOMS) -> float:
        code, line = kernel_command(f"theorem kiln_goal : {statement} := by", proof, "kiln_goal")
        result = await session.run(LeanRequest(op="run_code", code=code, timeout_s=300), "k")
        return kernel_verdict(result, "kiln_goal", line, allowed).reward

    statement = "\u2200 p : Prop, p \u2192 p \u2227 True"
    try:
        assert await reward(statement, "intro p h\nexact \u27e8h, trivial\u27e9") == 1
        assert await reward(statement, "intro p h\nsorry") == 0
        assert await reward("2 + 2 = 4", "native_decide") == 0
        assert await reward("2 + 2 = 4", "native_decide", (*ALLOWED_AXIOMS, "Lean.ofReduceBool")) == 1
        assert await reward("2 + 2 = 4", "decide") == 1
        for attack, completion in ATTACKS.items():
            assert refusal(completion) is not None, attack
            assert await reward(statement, completion) == 0, attack
    finally:
        await session.pool.close()
