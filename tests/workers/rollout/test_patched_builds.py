"""A patch is judged compiled: on a CMake image (CTest runs the binaries under build/ as they were built) the
``tests`` verifier's run brings the build up to date before the tests, so a patch that breaks ``add`` fails the test
that calls it and one that does not compile scores 0 — neither scores as the unpatched code would."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.schemas.rl import RolloutTask
from kiln.streams.settings import KilnSettings
from tests.workers.builder.projects import CALC_C
from tests.workers.rollout.verdicts import judged_patches

pytestmark = pytest.mark.docker


def _rewrite(source: str) -> str:
    return "".join(difflib.unified_diff(CALC_C.splitlines(keepends=True), source.splitlines(keepends=True),
                                        "a/calc.c", "b/calc.c"))


async def test_a_patch_is_compiled_before_ctest_judges_it(stage_topics: Callable[..., KilnSettings],
                                                           cmake_image: str, tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("exec.requests", 2))
    completions = {"equivalent": _rewrite(CALC_C.replace("a + b", "b + a")),
                   "breaks add": _rewrite(CALC_C.replace("a + b", "a - b")),
                   "does not compile": _rewrite(CALC_C.replace("a + b;", "a + ;"))}
    task = RolloutTask(task_id="add", prompt="Refactor add.", verifier="tests",
                       check={"image": cmake_image, "timeout_s": 120})
    verdicts = await judged_patches(settings, tmp_path / "locks", f"verifier-{unique}", task,
                                    list(completions.values()), "cmake")
    rewards = {name: v.reward for name, v in zip(completions, verdicts, strict=True)}
    assert rewards == {"equivalent": 1.0, "breaks add": 0.0, "does not compile": 0.0}, verdicts
