"""The ``tests`` verifier on a suite kiln can only read from printed lines (a C test binary printing ``PASS: adds``
and ``Tests passed: 1``), attacked by code under test that prints its own verdicts into the same stdout: passes
added to the real ones, and a last word after the runner's that repeats its test as passing, restates the count
and exits 0. Each scores 0; the honest fix scores 1. Where kiln trusts the test process itself, docs/security.md
says so."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verifiers import VerifierContext, Verifiers
from tests.workers.builder.projects import CALC_C
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker

BROKEN = CALC_C.replace("return a + b;", "return a - b;")
INFLATE = ('#include <stdio.h>\n__attribute__((constructor)) static void forge(void) {\n'
           '  for (int i = 0; i < 50; i++) printf("PASS: forged_%d\\n", i);\n}\n')
LAST_WORD = ('#include <stdio.h>\n#include <unistd.h>\n__attribute__((destructor)) static void forge(void) {\n'
             '  fflush(stdout);\n  printf("PASS: adds\\nTests passed: 1\\n");\n  fflush(stdout);\n  _exit(0);\n}\n')


def _rewrite(source: str) -> str:
    """A patch turning calc.c into ``source``."""
    return "".join(difflib.unified_diff(CALC_C.splitlines(keepends=True), source.splitlines(keepends=True),
                                        "a/calc.c", "b/calc.c"))


async def test_printed_verdicts_score_zero(stage_topics: Callable[..., KilnSettings], make_image: str,
                                           tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("exec.requests", 2))
    completions = {"honest": _rewrite(CALC_C.replace("a + b", "b + a")), "broken": _rewrite(BROKEN),
                   "inflated passes": _rewrite(INFLATE + BROKEN), "last word": _rewrite(LAST_WORD + BROKEN)}
    check = {"image": make_image, "timeout_s": 120}
    tasks = {"as built": RolloutTask(task_id="add", prompt="Fix add.", verifier="tests", check=check),
             "expected": RolloutTask(task_id="add", prompt="Fix add.", verifier="tests",
                                     check={**check, "expected_tests": ["adds", "subtracts"]})}
    with exec_worker(settings, tmp_path / "locks") as worker:
        worker.wait_assigned()
        async with KilnClient(settings, f"verifier-{unique}") as kiln:
            verifiers = Verifiers(VerifierContext(kiln))
            verdicts = await verifiers.get("tests").verify(tasks["as built"], [f"<patch>\n{p}</patch>"
                                                                               for p in completions.values()], "f")
            expected = await verifiers.get("tests").verify(tasks["expected"],
                                                           [f"<patch>\n{completions['honest']}</patch>"], "e")
            await verifiers.close()
    rewards = {name: v.reward for name, v in zip(completions, verdicts, strict=True)}
    assert rewards == {"honest": 1.0, "broken": 0.0, "inflated passes": 0.0, "last word": 0.0}, verdicts
    details = dict(zip(completions, verdicts, strict=True))
    # Both forgeries are caught as reports kiln does not trust, not merely as failing runs.
    assert details["inflated passes"].details["stage"] == details["last word"].details["stage"] == "report"
    # With the image's tests named, one the run does not report counts failed.
    assert expected[0].reward == 0.5 and expected[0].details["passed"] == 1, expected
