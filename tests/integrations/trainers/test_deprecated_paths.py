"""The import paths trainer configs named before the integrations had a package of their own keep working for one
release: each old module warns and hands out the very objects of the new one."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

MOVED = {
    "kiln.workers.trainers": ("kiln.integrations.trainers", ["configure", "shared_client", "task_of"]),
    "kiln.workers.trainers.verl": ("kiln.integrations.trainers.verl", ["compute_score", "compute_score_batch"]),
    "kiln.workers.trainers.areal": ("kiln.integrations.trainers.areal", ["reward_fn", "async_reward_fn"]),
    "kiln.workers.trainers.openrlhf": ("kiln.integrations.trainers.openrlhf",
                                       ["RewardRequest", "RewardResponse", "completion_of", "rewards"]),
    "kiln.workers.trainers.prime": ("kiln.integrations.trainers.prime", ["KilnTask", "KilnTaskData"]),
    "kiln.workers.rewards": ("kiln.integrations.trainers.trl",
                             ["TestsPassRatio", "OutputMatches", "LeanProofAccepted", "Verified", "completion_text"]),
}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_same_objects(old: str) -> None:
    new, names = MOVED[old]
    # What the prime adapter imports: `verifiers.v1` (a bare `verifiers` can be a namespace package of the suite's
    # own, tests/workers/verifiers, once the suite has put tests/workers on sys.path).
    if old.endswith(".prime") and not _installed("verifiers.v1"):
        pytest.skip("prime-rl's `verifiers` package is not installed here")
    for loaded in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        del sys.modules[loaded]  # a first import warns; an earlier test's import would hide it
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated, use {new}"):
        module = importlib.import_module(old)
    current = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(current, name), name
