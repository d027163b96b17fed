"""``OutputMatches``: a batch of programs scored by what they print on the row's stdin, each in an exec ``run_once``
call — including programs that try to pass without computing the answer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.integrations.trainers.trl import OutputMatches
from kiln.streams.settings import KilnSettings
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker

SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
# Prints the right answer on a channel it does not own (its reporter's stdout) and its own wrong one, then exits 0.
FORGE = ("import os\na, b = map(int, input().split())\nfor pid in os.listdir('/proc'):\n"
         "    try:\n        open(f'/proc/{pid}/fd/1', 'w').write(f'{a + b}\\n')\n    except Exception:\n"
         "        pass\nprint(a - b)\n")


def test_programs_are_scored_by_their_output(stage_topics: Callable[..., KilnSettings], tmp_path: Path) -> None:
    settings = stage_topics(("exec.requests", 2))
    with exec_worker(settings, tmp_path / "locks") as worker:
        worker.wait_assigned()
        reward = OutputMatches("python", settings=settings, timeout_s=10)
        try:
            completions = [f"```python\n{SUM}```", SUM, "print(5)", "import sys; print(7); sys.exit(1)",
                           "while True: pass", FORGE]
            scores = reward(completions, stdin=["2 3\n", "3 4\n", "2 3\n", "3 4\n", "1 1\n", "3 4\n"],
                            expected_output=["5\n", "7", "5", "7", "2", "7"])
        finally:
            reward.close()
    # Right (fenced, bare); a constant that happens to match; a right answer with a failing exit; a timeout; the
    # forger, which printed 3 - 4.
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
