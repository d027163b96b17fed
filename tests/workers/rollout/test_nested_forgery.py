"""The ``tests`` verifier on a cargo suite with a nested harness (tests/workers/builder/more_systems.py: two unit
tests, and one libtest test ``ui`` whose harness prints trybuild's ``test <file> [should pass] ... ok`` lines),
attacked through the narrowed consistency check: the code under test writes lines straight to the terminal, as the
harness does. A line with a libtest name (the failing test "passing") scores 0; lines shaped like the harness's are
no case, so they gain nothing over the broken patch itself; the honest fix scores 1."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.schemas.rl import RolloutTask
from kiln.streams.settings import KilnSettings
from tests.stages import _built_image
from tests.workers.builder.more_systems import NESTED_LIB_RS, nested_harness_project
from tests.workers.rollout.verdicts import judged_patches

pytestmark = pytest.mark.docker

BROKEN = NESTED_LIB_RS.replace("    a + b\n", "    a - b\n")


def _printing(line: str, times: int = 1) -> str:
    """The broken add(), writing ``line`` to stderr itself on every call (as a nested harness would: libtest
    captures print! and eprint!, not the stream)."""
    body = (f"    use std::io::Write;\n    for _ in 0..{times} {{\n        let _ = writeln!(std::io::stderr(), "
            f"{json.dumps(line)});\n    }}\n    a - b\n")
    return BROKEN.replace("    a - b\n", body)


def _rewrite(source: str) -> str:
    return "".join(difflib.unified_diff(NESTED_LIB_RS.splitlines(keepends=True), source.splitlines(keepends=True),
                                        "a/src/lib.rs", "b/src/lib.rs"))


@pytest.fixture(scope="module")
def nested_image(docker_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _built_image(docker_engine, tmp_path_factory.mktemp("nested-image"), nested_harness_project,
                        "demo/nested")


async def test_nested_harness_forgeries_gain_nothing(stage_topics: Callable[..., KilnSettings], nested_image: str,
                                                     tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("exec.requests", 2))
    completions = {"honest": _rewrite(NESTED_LIB_RS.replace("a + b", "b + a")), "broken": _rewrite(BROKEN),
                   "libtest-named pass": _rewrite(_printing("test tests::adds ... ok")),
                   "harness-shaped passes": _rewrite(_printing("test tests/ui/forged.rs [should pass] ... ok", 20))}
    task = RolloutTask(task_id="add", prompt="Fix add.", verifier="tests",
                       check={"image": nested_image, "timeout_s": 300})
    verdicts = await judged_patches(settings, tmp_path / "locks", f"verifier-{unique}", task,
                                    list(completions.values()), "nested")
    rewards = {name: v.reward for name, v in zip(completions, verdicts, strict=True)}
    details = dict(zip(completions, verdicts, strict=True))
    # 3 tests: adds and ui fail with the broken add(), multiplies passes.
    assert rewards == {"honest": 1.0, "broken": pytest.approx(1 / 3), "libtest-named pass": 0.0,
                       "harness-shaped passes": pytest.approx(1 / 3)}, verdicts
    assert details["libtest-named pass"].details["stage"] == "report"
    assert details["harness-shaped passes"].details == details["broken"].details
