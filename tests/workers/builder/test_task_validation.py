"""``kiln tasks validate`` on fixture tasks over a built project and a real exec worker: a task with a FAIL_TO_PASS
test, one whose new test is flaky, one whose FAIL_TO_PASS is empty, one whose gold patch does not apply; and the
``swe`` verifier rewarding exactly the validated contract."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.rl.tasks import Problem, RepositoryTasks
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.builder.tasks import validate
from kiln.workers.exec.client import ExecClient
from kiln.workers.verifiers import InvalidTask, VerifierContext, Verifiers
from tests.workers.builder.projects import CALC_PY
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker


def diff(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "/dev/null" if not old else f"a/{path}", f"b/{path}"))


def calc_patch(extra: str, source: str = CALC_PY) -> str:
    return diff("calc/__init__.py", CALC_PY, source + extra)


TEST_NEG = diff("tests/test_neg.py", "", "from calc import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n")
TEST_COIN = diff("tests/test_coin.py", "", "import random\n\n\ndef test_coin():\n"
                                           "    assert random.SystemRandom().random() < 0.5\n")
TEST_ADD_ZERO = diff("tests/test_zero.py", "", "from calc import add\n\n\ndef test_add_zero():\n"
                                               "    assert add(0, 1) == 1\n")
GOLD = calc_patch("\n\ndef neg(a):\n    return -a\n")
WRONG = calc_patch("\n\ndef neg(a):\n    return a\n")
BREAKS_MUL = calc_patch("\n\ndef neg(a):\n    return -a\n", CALC_PY.replace("return a * b", "return a + b"))
EXITS_CLEAN = calc_patch("\n\nimport os\nos._exit(0)\n")
PASSING_BEFORE = ["tests.test_calc.test_add", "tests.test_calc.test_mul"]


async def test_tasks_validate_fail_to_pass_and_the_swe_reward(stage_topics: Callable[..., KilnSettings],
                                                              project_image: str, tmp_path: Path,
                                                              unique: str) -> None:
    settings = stage_topics(("exec.requests", 4))
    with exec_worker(settings, tmp_path / "locks") as worker:
        worker.wait_assigned()
        async with KilnClient(settings, f"tasks-{unique}") as kiln:
            execs = ExecClient(kiln)
            task = await validate(execs, project_image, TEST_NEG, GOLD, runs=2)
            assert (task.valid, task.fail_to_pass, task.pass_to_pass, task.flaky) == (
                True, ["tests.test_neg.test_neg"], PASSING_BEFORE, []), task
            assert task.runs == 2 and task.seconds > 0

            # A coin-flip test: over six runs each way it changes on some side; it lands in neither list.
            flaky = await validate(execs, project_image, TEST_NEG + TEST_COIN, GOLD, runs=6)
            assert (flaky.valid, flaky.fail_to_pass, flaky.flaky) == (
                True, ["tests.test_neg.test_neg"], ["tests.test_coin.test_coin"]), flaky
            assert "tests.test_coin.test_coin" not in flaky.pass_to_pass

            # The new test passes before the gold patch: nothing fails to pass, the task is not valid.
            empty = await validate(execs, project_image, TEST_ADD_ZERO, calc_patch("\n\n# neg comes later\n"))
            assert (empty.valid, empty.failure, empty.fail_to_pass) == (False, "fail_to_pass_empty", [])
            assert "tests.test_zero.test_add_zero" in empty.pass_to_pass and "FAIL_TO_PASS is empty" in empty.reason

            stale = await validate(execs, project_image, TEST_NEG, GOLD.replace("return a * b", "return a ** b"))
            assert (stale.valid, stale.failure) == (False, "patch_does_not_apply"), stale
            assert stale.reason.startswith("the gold patch does not apply"), stale

            tasks = RepositoryTasks("demo/exec", project_image,
                                    [Problem.validated("neg", "Add neg(a) to calc.", TEST_NEG, task)])
            rollout_task = tasks.task(tasks.problems[0])
            assert rollout_task.check["fail_to_pass"] == ["tests.test_neg.test_neg"]
            verifiers = Verifiers(VerifierContext(kiln, exec_calls=2))
            verdicts = await verifiers.get("swe").verify(
                rollout_task, [f"<patch>{p}</patch>" for p in (GOLD, WRONG, BREAKS_MUL, EXITS_CLEAN)], "swe")
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0, 0.0], [v.details for v in verdicts]
    assert verdicts[1].details["fail_to_pass_not_passing"] == ["tests.test_neg.test_neg"]
    assert verdicts[2].details["pass_to_pass_not_passing"] == ["tests.test_calc.test_mul"]
    assert verdicts[3].details["stage"] == "report"
    with pytest.raises(InvalidTask, match="is not valid"):
        Problem.validated("zero", "nothing to do", TEST_ADD_ZERO, empty)
