"""``TestsPassRatio``: a batch of completions scored by the repository's tests in exec ``run_once`` calls, all at
once — and the patches a policy would use to write its own verdict, scored 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.integrations.trainers.trl import TestsPassRatio
from kiln.streams.settings import KilnSettings
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker

BREAK_MUL = """--- a/calc/__init__.py
+++ b/calc/__init__.py
@@ -9,4 +9,4 @@ def sub(a, b):
 def mul(a, b):
     if a == 0:
         return 0
-    return a * b
+    return a + b
"""
EXIT_ZERO = BREAK_MUL.replace("@@ -9,4 +9,4 @@", "@@ -9,4 +9,6 @@") + "+import os\n+os._exit(0)\n"
ADD_TEST = """--- /dev/null
+++ b/tests/test_sub.py
@@ -0,0 +1,5 @@
+from calc import sub
+
+
+def test_sub():
+    assert sub(5, 3) == 2
"""


# A plugin that turns every failure into a pass, in each place pytest would load one from, under every prefix.
FORGE = "import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n" \
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"


INI = "[pytest]\naddopts = -p calc.forge"


def _new_file(path: str, text: str, prefix: tuple[str, str] = ("a", "b")) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return f"--- /dev/null\n+++ {prefix[1]}/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


def test_a_batch_is_scored_by_the_repository_tests(stage_topics: Callable[..., KilnSettings], project_image: str,
                                                   tmp_path: Path) -> None:
    settings = stage_topics(("exec.requests", 2))
    with exec_worker(settings, tmp_path / "locks") as worker:
        worker.wait_assigned()
        reward = TestsPassRatio(project_image, settings=settings, timeout_s=120)
        try:
            honest = [f"I broke it.\n<patch>\n{BREAK_MUL}</patch>", "not a patch at all",
                      f"<patch>\n{_new_file('calc/extra.py', 'X = 1')}</patch>"]
            # Each would decide its own reward if applied: it breaks mul and ships a verdict-writing plugin or test.
            forged = [[{"role": "assistant", "content": f"```diff\n{ADD_TEST}```"}],
                      f"<patch>\n{BREAK_MUL}{_new_file('conftest.py', FORGE)}</patch>",
                      f"<patch>\n{BREAK_MUL}{_new_file('calc/conftest.py', FORGE, ('x', 'y'))}</patch>",
                      f"<patch>\n{BREAK_MUL}{_new_file('pytest.ini', INI)}</patch>",
                      f"<patch>\n{_new_file('sitecustomize.py', 'import os')}</patch>",
                      f"<patch>\n{EXIT_ZERO}</patch>"]  # ends pytest with 0 before any test ran
            scores = reward(honest + forged, prompt=[f"p{i}" for i in range(len(honest) + len(forged))])
        finally:
            reward.close()
    # mul broken: 1 of 2 tests pass; nothing applies: 0; an unrelated new module: 2 of 2; every forgery: 0.
    assert scores == [0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
