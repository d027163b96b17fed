"""Verifiers: a reward for every sample of a prompt group, computed by kiln's own stages through their client facades.

A library (no spec): the rollout stage and the ``verify`` stage both use it, one implementation for both. Built in
(``BUILT_IN``), by family:

- ``exact_match`` (``exact``): in process, the number a completion starts with equals the task's answer.
- ``exec`` (``exec``): one exec ``run_once`` call checks a whole group with the task's checker; groups with the same
  checker verified at the same time share that call.
- ``lean`` and ``lean_code`` (``lean``): every completion, as the proof of the task's unchanged statement, checked by
  Lean's kernel as one command in a fresh environment, its axioms (``#print axioms``) only allowed ones; completions
  that add commands, declarations, options or attributes are refused before they run.
- ``swe`` and ``tests`` (``repository``): the completion's patch applied to a builder-built image of a repository,
  then the task's tests (``swe``: with FAIL_TO_PASS / PASS_TO_PASS, the SWE-bench contract) or the image's own test
  command (``tests``: the share of its tests that pass).
- ``program`` (``programs``): the completion's program run on the task's stdin, checked against its expected output.

``contract`` holds what they share (``Verifier``, ``VerifierContext``, ``Verdict``, ``checked``; ``measured`` and
``POLICY_ERRORS``: what is the completion's own failure, a real 0, rather than kiln's), ``errors`` their errors
(``unjudged``: the error of a group with a completion kiln could not judge), ``registry`` the ``Verifiers`` a worker
knows (``Verifiers.stamped``: every verdict named with its verifier and version), ``version`` what a verdict's
version digests (the verifier's source, the task's check, its images). A user plugs in their own through the
``kiln.verifiers`` entry point group: ``name = "module:factory"``, the factory takes a ``VerifierContext`` and
returns a ``Verifier``.
``RolloutTask.check`` carries what the verifier needs; each validates it with its own model, and a task it cannot read
fails as a routine error (dead-lettered with the reason).
"""

from __future__ import annotations

from kiln.workers.verifiers.contract import (
    FAILURES,
    POLICY_ERRORS,
    POLICY_FAILURES,
    SENT_TOGETHER,
    Failure,
    Verdict,
    Verifier,
    VerifierContext,
    checked,
    measured,
)
from kiln.workers.verifiers.errors import CheckTimeout, InvalidTask, SandboxError, VerifyError, unjudged
from kiln.workers.verifiers.exact import ExactMatch, exact_match
from kiln.workers.verifiers.exec import ExecCheck, ExecVerifier, parse_verdicts
from kiln.workers.verifiers.lean import LeanCheck, LeanCodeCheck, LeanCodeVerifier, LeanVerifier
from kiln.workers.verifiers.programs import PROGRAM_RUNNERS, ProgramCheck, ProgramVerifier
from kiln.workers.verifiers.registry import BUILT_IN, Verifiers
from kiln.workers.verifiers.repository import SWECheck, SWEVerifier, TestsCheck, TestsVerifier

__all__ = [
    "BUILT_IN", "FAILURES", "POLICY_ERRORS", "POLICY_FAILURES", "PROGRAM_RUNNERS", "SENT_TOGETHER", "CheckTimeout",
    "ExactMatch", "ExecCheck", "ExecVerifier", "Failure", "InvalidTask", "LeanCheck", "LeanCodeCheck",
    "LeanCodeVerifier", "LeanVerifier", "ProgramCheck", "ProgramVerifier", "SWECheck", "SWEVerifier", "SandboxError",
    "TestsCheck", "TestsVerifier", "Verdict", "Verifier", "VerifierContext", "Verifiers", "VerifyError", "checked",
    "exact_match", "measured", "parse_verdicts", "unjudged",
]
