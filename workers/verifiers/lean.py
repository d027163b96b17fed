"""The Lean verifiers. A reward of 1 is the kernel's verdict on the task's own statement, never tactic mode's:

- ``lean``: the completion is a tactic script for ``theorem kiln_goal : <statement> := by``; ``lean_code``: it
  follows the task's ``statement`` (``theorem t : p → p := by``), which names the theorem.
- A completion that could reach around the check is refused before anything runs: any command, declaration, option,
  attribute or meta-programming keyword (``#eval``, ``set_option``, ``axiom``, ``notation``, ``instance``,
  ``run_tac``, ``elab``, ``@[implemented_by …]``, …), and ``sorry``/``admit``. A proof needs none of them.
- The statement with the completion as its proof is checked as one command in a fresh environment (the task's
  header only), followed by ``#print axioms <name>``. Reward 1 needs: no error (the kernel's included), no ``sorry``,
  and exactly one axiom report for the declaration, at that command's own line, listing only allowed axioms
  (``propext``, ``Classical.choice``, ``Quot.sound`` by default; a task may allow more, e.g. ``Lean.ofReduceBool``
  for ``native_decide``). Names are compared whole, so an axiom named like an allowed one is not one.
- Tactic mode (``run_tactic`` on a proof state) stays what proof search uses (``LeanClient.explore``): it has
  accepted proofs the kernel rejects (leanprover-community/repl#44).
"""

from __future__ import annotations

import asyncio
import re
import textwrap

from pydantic import BaseModel, ConfigDict, Field

from kiln.schemas.lean import LeanResult
from kiln.schemas.rl import RolloutTask
from kiln.streams.errors import ClientError
from kiln.workers.verifiers.contract import PerCompletion, Verdict, checked
from kiln.workers.verifiers.errors import InvalidTask

ALLOWED_AXIOMS = ("propext", "Classical.choice", "Quot.sound")
GOAL = "kiln_goal"


class LeanCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    statement: str = Field(min_length=1, description="the proposition, as after `theorem name :`")
    header: list[str] = Field(default_factory=list)
    timeout_s: float = Field(30.0, gt=0, le=600)
    allowed_axioms: list[str] = Field(default_factory=lambda: list(ALLOWED_AXIOMS),
                                      description="axioms a proof may depend on (full names)")


class LeanCodeCheck(BaseModel):
    """The completion as the proof of ``statement`` (a named theorem up to its ``:=``, e.g. ``theorem t : p → p :=
    by``), checked by the kernel with ``#print axioms`` as ``lean`` checks."""

    model_config = ConfigDict(extra="forbid")

    statement: str = ""
    header: list[str] = Field(default_factory=list)
    timeout_s: float = Field(60.0, gt=0, le=600)
    allowed_axioms: list[str] = Field(default_factory=lambda: list(ALLOWED_AXIOMS))


# Everything a proof never needs and that adds to, or reaches around, what the kernel checks of the statement:
# commands (``#eval``, ``#print`` — a forged axiom report —, ``#exit``), declarations, options (``set_option
# debug.skipKernelTC``), attributes (``@[implemented_by]``, ``@[extern]``), notation, instances, macros and
# elaborators (meta code), scoping that would end the theorem (``end``, ``namespace``).
_REFUSED = re.compile(
    r"(?<![\w.'])(?:#[A-Za-z_]\w*|theorem|lemma|def|definition|example|abbrev|axiom|axioms|opaque|instance|class|"
    r"structure|inductive|coinductive|mutual|namespace|section|end|variable|variables|universe|import|set_option|"
    r"attribute|local|scoped|notation|infix|infixl|infixr|prefix|postfix|macro|macro_rules|syntax|elab|elab_rules|"
    r"run_cmd|run_tac|run_elab|run_meta|by_elab|declare_syntax_cat|initialize|builtin_initialize|implemented_by|extern|"
    r"unsafe|partial|noncomputable|private|protected|export|deriving|omit|include|sorry|admit)(?![\w'])|@\[")
_COMMENTS = re.compile(r"/-.*?-/|--[^\n]*", re.S)
_NAMED = re.compile(r"^\s*(?:theorem|lemma)\s+([^\s:({\[⦃]+)")


def refusal(proof: str) -> str | None:
    """Why a completion is refused before it runs (None: it is only a proof)."""
    if not proof.strip():
        return "empty proof"
    found = _REFUSED.search(_COMMENTS.sub(" ", proof))
    return f"a proof may not contain {found.group(0)!r}" if found else None


def kernel_command(statement_head: str, proof: str, name: str) -> tuple[str, int]:
    """The command the kernel checks: the statement (up to and including ``:= by`` or ``:=``) with the proof on the
    lines below it, then ``#print axioms name``; and that report's line (1-based)."""
    body = textwrap.indent(textwrap.dedent(proof).strip("\n"), "  ")
    code = f"{statement_head.rstrip()}\n{body}\n\n#print axioms {name}"
    return code, code.count("\n") + 1


def kernel_verdict(result: LeanResult, name: str, report_line: int, allowed: list[str] | tuple[str, ...]) -> Verdict:
    """The reward of one checked command: 1 only for a declaration the kernel accepted, without ``sorry``, whose one
    axiom report (at ``report_line``) lists only ``allowed`` axioms."""
    if result.error:
        return Verdict(reward=0.0, details={"error": result.error[:500]})
    errors = [m.data for m in result.messages if m.severity == "error"]
    if errors:
        return Verdict(reward=0.0, details={"error": errors[0][:500]})
    if result.sorries or any("sorry" in m.data and m.severity == "warning" for m in result.messages):
        return Verdict(reward=0.0, details={"error": "the proof uses sorry"})
    pattern = re.compile(rf"'{re.escape(name)}' (?:depends on axioms: \[(?P<axioms>.*?)\]|does not depend on any "
                         r"axioms)\s*$", re.S)
    reports = [m for m in result.messages if m.severity == "info" and pattern.match(m.data.strip())]
    own = [m for m in reports if (m.pos or {}).get("line") == report_line]
    if len(reports) != 1 or len(own) != 1:
        return Verdict(reward=0.0, details={"error": f"{len(reports)} axiom reports for {name}, "
                                                     f"{len(own)} at the check's own line"})
    match = pattern.match(own[0].data.strip())
    assert match is not None
    used = [a.strip() for a in (match.group("axioms") or "").replace("\n", " ").split(",") if a.strip()]
    extra = sorted(set(used) - set(allowed))
    if extra:
        return Verdict(reward=0.0, details={"error": f"depends on axioms not allowed: {', '.join(extra)}",
                                            "axioms": used})
    return Verdict(reward=1.0, details={"axioms": used})


class LeanVerifier(PerCompletion):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(LeanCheck, task)
        # The statement must elaborate to one goal (a task's defect, reported as such, not as every sample's zero).
        try:
            root = await self.lean.run_code(f"theorem {GOAL} : {check.statement} := by sorry", header=check.header,
                                            timeout_s=check.timeout_s, key=request_id)
        except ClientError as e:
            return [self.failed(e) for _ in completions]
        if not root.ok or len(root.sorries) != 1:
            raise InvalidTask(f"task {task.task_id}: the statement does not elaborate to one goal: "
                              f"{root.error or root.messages}")
        head = f"theorem {GOAL} : {check.statement} := by"
        return list(await asyncio.gather(*(judge(self, check.header, head, c, GOAL, check.timeout_s,
                                                 check.allowed_axioms, request_id) for c in completions)))


class LeanCodeVerifier(PerCompletion):
    async def verify(self, task: RolloutTask, completions: list[str], request_id: str) -> list[Verdict]:
        check = checked(LeanCodeCheck, task)
        named = _NAMED.match(check.statement)
        if named is None or not re.search(r":=\s*(?:by\s*)?$", check.statement):
            raise InvalidTask(f"task {task.task_id}: lean_code needs the statement a reward judges, a named theorem "
                              f"up to its ':=' (e.g. 'theorem t : p → p := by'), not {check.statement[:80]!r}")
        return list(await asyncio.gather(*(judge(self, check.header, check.statement, c, named.group(1),
                                                 check.timeout_s, check.allowed_axioms, request_id)
                                           for c in completions)))


async def judge(verifier: PerCompletion, header: list[str], head: str, completion: str, name: str, timeout_s: float,
                allowed: list[str], key: str) -> Verdict:
    """One completion: refused, or checked by the kernel as one command with its axiom report."""
    refused = refusal(completion)
    if refused:
        return Verdict(reward=0.0, details={"error": refused})
    code, report_line = kernel_command(head, completion, name)
    try:
        result = await verifier.lean.run_code(code, header=header, timeout_s=timeout_s, key=key)
    except ClientError as e:
        return verifier.failed(e)
    return kernel_verdict(result, name, report_line, allowed)


__all__ = ["ALLOWED_AXIOMS", "LeanCheck", "LeanCodeCheck", "LeanCodeVerifier", "LeanVerifier",
           "kernel_command", "kernel_verdict", "refusal"]
