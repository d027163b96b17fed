"""``kiln demo`` end to end, as ``make demo`` runs it: the repository → image → tests → rewards → learning story on
the real broker and Docker, no librdkafka line on the terminal, and the report picture where the demo says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.streams.settings import KilnSettings
from tests.conftest import _ensure


@pytest.mark.docker
@pytest.mark.timeout(900)
def test_the_demo_tells_the_whole_story(kafka: KilnSettings, docker_engine: object, tmp_path: Path) -> None:
    _ensure("lean")
    env = {**os.environ, "KILN_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "COLUMNS": "200",
           "KILN_DEMO_TARGET": "0.1", "KILN_DEMO_DEADLINE_S": "90"}
    ran = subprocess.run([str(Path(sys.executable).parent / "kiln"), "demo"], capture_output=True, text=True,
                         env=env, timeout=800)
    said = ran.stdout + ran.stderr
    assert ran.returncode == 0, said
    for chapter in ("repository → Saucer", "revision → image", "tests in an exec session", "candidate patches",
                    "the FAKE REPL", "learning"):
        assert chapter in said, chapter
    assert re.search(r"multiplies\s+3 / 0\s+1\.00", said), said  # the right fix: every test passes
    assert re.search(r"deletes the failing tests\s+not run\s+0\.00", said), said  # touching the tests: 0, unrun
    assert re.search(r"accuracy 0\.\d\d → 0\.\d\d", said)
    picture = Path(re.findall(r"report picture: (\S+)", said)[-1])
    assert picture.suffix == ".png" and picture.stat().st_size > 10_000
    assert not re.search(r"%\d\|\d+\.\d+\||\[rdkafka#|Traceback", said), said
