"""The trainer adapters' tests run against the verify stage's stack (an exec worker and a verify worker, the verify
tests' fixtures); the TRL test needs the ``rl`` extra (torch, trl), without it that file is not collected."""

from __future__ import annotations

from tests.collection import unless_importable
from tests.workers.verify.conftest import stack, verify_settings

# KILN_RL=0: no rl environment; the root conftest lists what was left out (tests/collection.py).
collect_ignore_glob = unless_importable(__file__, "trl", "test_trl*.py", "needs the rl extra: trl")

__all__ = ["collect_ignore_glob", "stack", "verify_settings"]
