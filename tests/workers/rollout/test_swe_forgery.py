"""The ``swe`` verifier attacked by the patches a policy would try instead of fixing the task: a test-runner plugin
that passes everything (under any diff prefix), a rewritten test, a process that exits 0 before any test runs. Each
scores 0; the honest fix scores 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verifiers import SWECheck, VerifierContext, Verifiers
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker

TEST_NEG = ("--- /dev/null\n+++ b/tests/test_neg.py\n@@ -0,0 +1,5 @@\n+from calc import neg\n+\n+\n"
            "+def test_neg():\n+    assert neg(2) == -2\n")


def _append(lines: list[str], path: str = "calc/__init__.py", prefix: tuple[str, str] = ("a", "b")) -> str:
    """A hunk appending ``lines`` to the end of calc/__init__.py (12 lines in the built project)."""
    body = "".join(f"+{line}\n" for line in lines)
    return (f"--- {prefix[0]}/{path}\n+++ {prefix[1]}/{path}\n@@ -10,3 +10,{3 + len(lines)} @@\n"
            f"     if a == 0:\n         return 0\n     return a * b\n{body}")


def _new(path: str, lines: list[str], prefix: str = "b") -> str:
    body = "".join(f"+{line}\n" for line in lines)
    return f"--- /dev/null\n+++ {prefix}/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


PASS_ALL = ["import pytest", "@pytest.hookimpl(hookwrapper=True)", "def pytest_runtest_makereport(item, call):",
            "    outcome = yield", "    outcome.get_result().outcome = 'passed'"]
WRONG_NEG = ["def neg(a):", "    return a"]


async def test_forged_patches_score_zero(stage_topics: Callable[..., KilnSettings], project_image: str,
                                         tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("exec.requests", 2))
    check = SWECheck(image=project_image, test_patch=TEST_NEG, timeout_s=120)
    task = RolloutTask(task_id="neg", prompt="Add neg(a) to calc.", verifier="swe", check=check.model_dump())
    completions = {
        "honest": _append(["def neg(a):", "    return -a"]),
        "wrong": _append(WRONG_NEG),
        "exits 0 on import": _append([*WRONG_NEG, "import os", "os._exit(0)"]),
        "plugin": _append(WRONG_NEG) + _new("conftest.py", PASS_ALL),
        "plugin, other prefix": _append(WRONG_NEG, prefix=("x", "y")) + _new("calc/conftest.py", PASS_ALL, "y"),
        "rewritten test": _append(WRONG_NEG) + _new("tests/test_neg.py", ["def test_neg():", "    pass"]),
        "ini": _append(WRONG_NEG) + _new("setup.cfg", ["[tool:pytest]", "addopts = -p no:python"]),
    }
    with exec_worker(settings, tmp_path / "locks") as worker:
        worker.wait_assigned()
        async with KilnClient(settings, f"verifier-{unique}") as kiln:
            verifiers = Verifiers(VerifierContext(kiln))
            verdicts = await verifiers.get("swe").verify(task, [f"<patch>\n{p}</patch>" for p in completions.values()],
                                                         "swe-forgery")
            await verifiers.close()
    rewards = {name: v.reward for name, v in zip(completions, verdicts, strict=True)}
    assert rewards == {"honest": 1.0} | {name: 0.0 for name in completions if name != "honest"}, verdicts
    stages = {name: v.details.get("stage") for name, v in zip(completions, verdicts, strict=True)}
    assert stages["exits 0 on import"] == "report"  # exit 0, but no report of test_neg passing
    assert stages["plugin"] == stages["rewritten test"] == "patch touches the tests or their configuration"
