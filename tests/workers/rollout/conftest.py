"""The rollout and trainer pieces need torch (the ``rl`` extra); without it these tests are not collected."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]
