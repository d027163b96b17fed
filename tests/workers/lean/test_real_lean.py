"""The Lean stage's session against a real Lean REPL. Runs only where one is installed:
KILN_LEAN_REPL = the ``repl`` binary (leanprover-community/repl), KILN_LEAN_PROJECT = a Lake project directory
(its search path provides the imports). Lean cannot be installed on the CI machine, so there it skips."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kiln.schemas.lean import LeanRequest
from kiln.workers.lean.pool import ReplPool
from kiln.workers.lean.repl import Header, ReplLimits, ReplProcess
from kiln.workers.lean.session import LeanSession, StateCodec

REPL = os.environ.get("KILN_LEAN_REPL")
PROJECT = os.environ.get("KILN_LEAN_PROJECT")
pytestmark = pytest.mark.skipif(
    not (REPL and PROJECT and shutil.which(shlex.split(REPL)[0]) and Path(PROJECT).is_dir()),
    reason="no real Lean REPL here (set KILN_LEAN_REPL and KILN_LEAN_PROJECT)")


async def test_real_repl_runs_code_tactics_and_moves_states(tmp_path: Path) -> None:
    assert REPL and PROJECT
    lean_path = (await asyncio.to_thread(subprocess.run, ["lake", "env", "printenv", "LEAN_PATH"], cwd=PROJECT,
                                         capture_output=True, text=True, check=True)).stdout.strip()
    env = {**os.environ, "LEAN_PATH": lean_path}
    counter = iter(range(100))

    def factory(header: Header) -> ReplProcess:
        return ReplProcess(shlex.split(REPL), header, tmp_path / f"p{next(counter)}", ReplLimits(), cwd=Path(PROJECT),
                           env=env)

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
