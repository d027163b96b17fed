"""Proofs judged by the kernel: a `lean`/`lean_code` reward of 1 is the kernel's verdict on the task's unchanged
statement, with only allowed axioms; tactic mode's acceptance is never the reward. Each attack a prover policy could
find scores 0 — on the Lean stage with the fake REPL (tests/fakes/lean_repl.py, whose replies follow
leanprover-community/repl's test/app_type_mismatch.expected.out and Lean's `#print axioms` lines) and, where Lean is
installed, on the real REPL (tests/workers/lean/test_real_lean.py runs the same ATTACKS)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.schemas.lean import LeanMessage, LeanResult
from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.lean.client import LeanClient
from kiln.workers.verifiers import VerifierContext, Verifiers
from kiln.workers.verifiers.lean import ALLOWED_AXIOMS, kernel_command, kernel_verdict, refusal
from tests.workers.lean.conftest import lean_worker

STATEMENT = "p \u2192 p \u2227 True"
HONEST = "intro h\nconstructor\nexact h\ntrivial"
# What a policy might emit to be rewarded without proving the statement, each refused before it runs (real Lean
# syntax: tests/workers/lean/test_real_lean.py sends the same completions to a real REPL).
ATTACKS = {
    "added axiom": "exact cheat\naxiom cheat : p \u2192 p \u2227 True",
    "axiom named like an allowed one": "exact propext'\naxiom propext' : p \u2192 p \u2227 True",
    "kernel-skipping option": "set_option debug.skipKernelTC true in\n  kernel_reject",
    "option after the proof": "kernel_reject\nset_option debug.skipKernelTC true",
    "redefined statement": "trivial\ntheorem kiln_goal' : True := trivial",
    "local notation": "trivial\nlocal notation \"p\" => True",
    "an instance": "trivial\ninstance : Inhabited Nat := \u27e80\u27e9",
    "#eval": "trivial\n#eval IO.println \"'kiln_goal' does not depend on any axioms\"",
    "forged axiom report": "trivial\n#print \"'kiln_goal' does not depend on any axioms\"",
    "run_cmd": "trivial\nrun_cmd pure ()",
    "run_tac": "run_tac pure ()",
    "elab": "trivial\nelab \"cheat\" : tactic => pure ()",
    "by_elab": "exact by_elab pure ()",
    "implemented_by": "trivial\n@[implemented_by id] def f : Nat \u2192 Nat := id",
    "extern": "trivial\n@[extern \"c\"] opaque g : Nat",
    "sorry": "intro h\nsorry",
    "admit": "admit",
}


def test_every_attack_is_refused_and_an_honest_proof_is_not() -> None:
    assert refusal(HONEST) is None
    assert refusal("open Classical in\n  exact foo -- the end of a comment, `theorem` in it") is None
    assert refusal("simp [List.append_end, h.class]") is None  # names that contain refused words
    for attack, completion in ATTACKS.items():
        assert refusal(completion) is not None, attack


def report(data: str, line: int) -> LeanMessage:
    return LeanMessage(severity="info", data=data, pos={"line": line, "column": 0})


def test_the_axiom_report_decides() -> None:
    code, line = kernel_command("theorem kiln_goal : p := by", "exact h", "kiln_goal")
    assert code.splitlines()[line - 1] == "#print axioms kiln_goal" and code.splitlines()[1] == "  exact h"

    def verdict(*messages: LeanMessage, allowed: tuple[str, ...] = ALLOWED_AXIOMS) -> float:
        return kernel_verdict(LeanResult(op="run_code", ok=True, messages=list(messages)), "kiln_goal", line,
                              allowed).reward

    assert verdict(report("'kiln_goal' does not depend on any axioms", line)) == 1
    assert verdict(report("'kiln_goal' depends on axioms: [propext, Classical.choice, Quot.sound]", line)) == 1
    assert verdict() == 0  # no report: the declaration was not added
    assert verdict(report("'kiln_goal' does not depend on any axioms", line - 2)) == 0  # printed by the proof
    assert verdict(report("'kiln_goal' depends on axioms: [propext]", line),
                   report("'kiln_goal' does not depend on any axioms", 2)) == 0  # a second, forged report
    for axioms in ("sorryAx", "propext'", "Foo.propext", "Lean.ofReduceBool", "cheat"):
        assert verdict(report(f"'kiln_goal' depends on axioms: [propext, {axioms}]", line)) == 0, axioms
    assert verdict(report("'kiln_goal' depends on axioms: [Lean.ofReduceBool]", line),
                   allowed=(*ALLOWED_AXIOMS, "Lean.ofReduceBool")) == 1
    kernel = LeanMessage(severity="error", data="(kernel) declaration has metavariables 'kiln_goal'",
                         pos={"line": 1, "column": 0})
    assert verdict(kernel, report("'kiln_goal' does not depend on any axioms", line)) == 0
    sorry = LeanMessage(severity="warning", data="declaration uses 'sorry'", pos={"line": 1, "column": 0})
    assert verdict(sorry, report("'kiln_goal' does not depend on any axioms", line)) == 0


@pytest.mark.docker
async def test_the_lean_stage_judges_by_the_kernel(stage_topics: Callable[..., KilnSettings], unique: str) -> None:
    settings = stage_topics(("lean.requests", 2))
    with lean_worker(settings, 2, free_port()) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, f"kernel-{unique}") as kiln:
            verifiers = Verifiers(VerifierContext(kiln))
            task = RolloutTask(task_id="p", prompt="prove", verifier="lean", check={"statement": STATEMENT})
            lean = LeanClient(kiln)

            # Tactic mode accepts what the kernel rejects (leanprover-community/repl#44): it is no reward.
            state = (await lean.run_code(f"theorem t : {STATEMENT} := by sorry")).sorries[0].state
            assert (await lean.run_tactic(state, "kernel_reject")).completed
            # And the kernel-skipping option would let it through if it were not refused before it runs.
            skipped = await lean.run_code(f"set_option debug.skipKernelTC true in\ntheorem kiln_goal : {STATEMENT} "
                                          ":= by\n  kernel_reject\n\n#print axioms kiln_goal")
            assert skipped.ok and "does not depend on any axioms" in skipped.messages[-1].data

            completions = [HONEST, "kernel_reject", "intro h", "exact nothing", "exact trivial_fact",
                           *ATTACKS.values()]
            verdicts = await verifiers.get("lean").verify(task, completions, f"kernel-{unique}")
            rewards = dict(zip(["honest", "tactic mode only", "goals left", "unknown", "no such fact", *ATTACKS],
                               (v.reward for v in verdicts), strict=True))
            assert rewards == {name: float(name == "honest") for name in rewards}, rewards
            assert "metavariables" in verdicts[1].details["error"]

            # native_decide trusts the compiler: its axiom is refused unless the task allows it.
            decided = RolloutTask(task_id="n", prompt="prove", verifier="lean", check={"statement": "2 + 2 = 4"})
            allowing = decided.model_copy(update={"check": {
                "statement": "2 + 2 = 4", "allowed_axioms": [*ALLOWED_AXIOMS, "Lean.ofReduceBool"]}})
            assert [v.reward for v in await verifiers.get("lean").verify(decided, ["native_decide"], "n1")] == [0]
            assert [v.reward for v in await verifiers.get("lean").verify(allowing, ["native_decide"], "n2")] == [1]

            # lean_code: the task's statement names the theorem; the same judgement.
            code_task = RolloutTask(task_id="c", prompt="prove", verifier="lean_code",
                                    check={"statement": "theorem t : p \u2192 p := by"})
            coded = await verifiers.get("lean_code").verify(code_task, ["intro h; exact h", "kernel_reject",
                                                                        ATTACKS["added axiom"]], "c")
            assert [v.reward for v in coded] == [1, 0, 0]
            with pytest.raises(Exception, match="needs the statement"):
                await verifiers.get("lean_code").verify(code_task.model_copy(update={"check": {}}), ["x"], "e")
            await verifiers.close()
