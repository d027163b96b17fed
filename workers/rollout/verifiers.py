"""The verifiers moved to the library ``kiln.workers.verifiers`` (the ``verify`` stage uses them too); this module
keeps the old import path."""

from __future__ import annotations

from kiln.workers.verifiers import (
    BUILT_IN,
    ExactMatch,
    ExecCheck,
    ExecVerifier,
    LeanCheck,
    LeanVerifier,
    SWECheck,
    SWEVerifier,
    Verdict,
    Verifier,
    VerifierContext,
    Verifiers,
    checked,
    exact_match,
    parse_verdicts,
)

__all__ = ["BUILT_IN", "ExactMatch", "ExecCheck", "ExecVerifier", "LeanCheck", "LeanVerifier", "SWECheck",
           "SWEVerifier", "Verdict", "Verifier", "VerifierContext", "Verifiers", "checked", "exact_match",
           "parse_verdicts"]
