"""The trainer adapters' tests run against the verify stage's stack (an exec worker and a verify worker, the verify
tests' fixtures); the TRL test needs the ``rl`` extra (torch, trl), without it that file is not collected.

The trainers' own code (verl, AReaL, OpenRLHF, ``verifiers``) comes from ``kiln setup trainers``
(``infra/trainers/trainers.sh``): its directories are appended to ``sys.path`` here, after kiln's environment, so
every adapter is driven through its trainer's installed code. ``trainer(module)`` imports one, or skips the test as
blocked with the import that failed."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import pytest

from kiln.streams.infra import infra_dir
from tests.collection import unless_importable
from tests.workers.verify.conftest import stack, verify_settings


def trainer_paths() -> list[str]:
    """The directories ``kiln setup trainers`` installed the trainers' code into (none when it did not run)."""
    done = subprocess.run(["bash", str(infra_dir() / "trainers" / "trainers.sh"), "path"], capture_output=True,
                          text=True, check=False)
    return done.stdout.split() if done.returncode == 0 else []


sys.path.extend(p for p in trainer_paths() if p not in sys.path)


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def trainer(module: str) -> ModuleType:
    """``module`` of a trainer's installed code; the test is blocked (skipped, saying which import failed) where it
    cannot be imported here, and fails where ``kiln setup trainers`` did not run."""
    if not trainer_paths():
        pytest.fail("the trainers' code is not installed: run `kiln setup trainers`")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"blocked: importing {module} failed here: {type(e).__name__}: {e}")


# KILN_RL=0: no rl environment; the root conftest lists what was left out (tests/collection.py).
collect_ignore_glob = [*unless_importable(__file__, "trl", "test_trl*.py", "needs the rl extra: trl"),
                       *unless_importable(__file__, "torch", "test_no_reward.py", "needs the rl extra: torch")]

__all__ = ["collect_ignore_glob", "importable", "stack", "trainer", "verify_settings"]
