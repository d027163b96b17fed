"""The TRL test needs the ``rl`` extra (torch, trl); without it that file is not collected."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("trl") is None:
    collect_ignore_glob = ["test_trl*.py"]
