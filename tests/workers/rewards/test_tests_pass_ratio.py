"""``TestsPassRatio``: a batch of completions scored by the repository's tests in exec sessions, all at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.streams.settings import KilnSettings
from kiln.workers.rewards import TestsPassRatio
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
ADD_TEST = """--- /dev/null
+++ b/tests/test_sub.py
@@ -0,0 +1,5 @@
+from calc import sub
+
+
+def test_sub():
+    assert sub(5, 3) == 2
"""


def test_a_batch_is_scored_by_the_repository_tests(stage_topics: Callable[..., KilnSettings], project_image: str,
                                                   tmp_path: Path) -> None:
    settings = stage_topics(("exec.requests", 2))
    with exec_worker(settings, tmp_path / "locks") as worker:
        worker.wait_assigned()
        reward = TestsPassRatio(project_image, settings=settings, timeout_s=120)
        try:
            scores = reward([f"I broke it.\n<patch>\n{BREAK_MUL}</patch>",
                             [{"role": "assistant", "content": f"```diff\n{ADD_TEST}```"}],
                             "not a patch at all"], prompt=["p1", "p2", "p3"])
        finally:
            reward.close()
    # mul broken: 1 of 2 tests pass; a new passing test: 3 of 3; nothing applies: 0.
    assert scores == [0.5, 1.0, 0.0]
