"""The rollout and trainer pieces need torch (the ``rl`` extra); without it these tests are not collected."""

from __future__ import annotations

from tests.collection import unless_importable

# KILN_RL=0: no rl environment; the root conftest lists what was left out (tests/collection.py).
collect_ignore_glob = unless_importable(__file__, "torch", "test_*.py", "needs the rl extra: torch")
