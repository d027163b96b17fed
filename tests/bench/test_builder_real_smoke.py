"""A bounded smoke run of ``bench/builder.py --real`` (the 36-project corpus lives in the bench): one small crate
fetched from its registry like every corpus project, ingested, built cold by the rules, and its tests counted
against what ``cargo test`` itself reports in the same image."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.builder import RealOutcome, build_real, human_command, human_count
from bench.corpus import Project, prepare, projects
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent
from kiln.schemas.reports import TestReport
from kiln.streams.blobstore import FileBlobStore

pytestmark = pytest.mark.docker


async def test_one_real_crate_builds_and_runs_every_test_its_own_command_runs(docker_engine: Any,
                                                                             tmp_path: Path) -> None:
    fnv = next(p for p in projects() if p.name == "fnv")
    source = prepare(fnv, tmp_path / "corpus")
    store = SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")
    result = await build_real(fnv, source, store, docker_engine, tmp_path / "work")
    assert result.usable, (result.event.failure, result.event.detail)
    tests = result.event.tests
    assert tests is not None and result.human >= 3 and tests.passed + tests.failed == result.human


def test_human_counts_come_from_each_tool_summary() -> None:
    assert human_count("python", "....\n=== 12 passed, 1 failed, 3 skipped in 0.52s ===\n") == 13
    assert human_count("cargo", "test result: ok. 3 passed; 0 failed; 1 ignored;\n"
                                "test result: FAILED. 2 passed; 1 failed; 0 ignored;\n") == 6
    assert human_count("go", "=== RUN TestA\n--- PASS: TestA (0.00s)\n    --- FAIL: TestA/sub (0.00s)\n") == 2
    assert human_count("npm", "TAP version 13\n# tests 9\n# pass  8\n# fail  1\n") == 9
    assert human_count("cmake", "100% tests passed, 0 tests failed out of 7\n") == 7
    assert human_count("autotools", "PASS: a\nFAIL: b\nSKIP: c\n# TOTAL: 3\n") == 2
    # npm runners and make-driven suites: the runner's own summary line, whichever runner it is.
    assert human_count("npm", "  calc\n    \u2713 adds\n\n  46 passing (12ms)\n  1 failing\n") == 47
    assert human_count("npm", "Tests:       1 failed, 46 passed, 47 total\n") == 47
    assert human_count("make", "cc -o t t.c\n./t\nTests passed: 349\n") == 349
    assert human_count("make", "[  PASSED  ] 2 tests.\n[  FAILED  ] 1 test, listed below:\n") == 3
    assert human_count("make", "nothing to count\n") == 0
    # A make target running another ecosystem's runner: that runner's summary (go test's lines under GOFLAGS=-v).
    assert human_count("make", "tox\n===== 4 passed, 1 failed in 0.30s =====\n") == 5
    assert human_count("make", "=== RUN TestA\n--- PASS: TestA (0.00s)\nok  \tx/y\t0.1s\n") == 1
    assert human_command(Project("debian", "p", "1", "make", "make && make test")).startswith("export GOFLAGS=-v;")
    # Maven's totals per module after "Results:" (the per-class lines, which go on with the time, are not summed).
    maven = ("[INFO] Tests run: 3, Failures: 0, Errors: 0, Skipped: 0, Time elapsed: 0.1 s - in a.T\n"
             "[INFO] Results:\n[INFO] Tests run: 3, Failures: 0, Errors: 0, Skipped: 0\n"
             "[ERROR] Tests run: 5, Failures: 1, Errors: 1, Skipped: 2\n")
    assert human_count("maven", maven) == 6
    assert human_count("meson", "Ok:                 7\nExpected Fail:      1\nFail:               2\n"
                                "Skipped:            3\nTimeout:            0\n") == 10
    # Gradle's result files' root suites, printed after the run (human_command): executed = tests - skipped.
    gradle = ('<testsuite name="a.T" tests="4" skipped="1" failures="1" errors="0" timestamp="x">\n'
              '<testsuite name="b.U" tests="2" skipped="0" failures="0" errors="0" timestamp="x">\n')
    assert human_count("gradle", "BUILD SUCCESSFUL in 9s\n" + gradle) == 5
    assert human_count("gradle", "BUILD SUCCESSFUL in 9s\n") == 0



def test_gradles_human_count_reads_the_result_files_of_this_run_only(tmp_path: Path) -> None:
    """A stale result file (an earlier run's, left in the image) is removed before the run; the run's own are
    printed after it and counted, and the command's exit status is the run's."""
    stale = tmp_path / "lib/build/test-results/test"
    stale.mkdir(parents=True)
    (stale / "TEST-old.Stale.xml").write_text('<testsuite name="old.Stale" tests="50" skipped="0">')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gradle").write_text(  # writes one result file, as Gradle's test task does, and fails one test
        "#!/bin/sh\nmkdir -p app/build/test-results/test\n"
        "echo '<testsuite name=\"a.T\" tests=\"3\" skipped=\"1\" failures=\"1\">' "
        "> app/build/test-results/test/TEST-a.T.xml\nexit 1\n")
    (bin_dir / "gradle").chmod(0o755)
    assert human_command(Project("debian", "p", "1", "maven", "mvn test")) == "mvn -o -s /opt/m2/settings.xml test"
    command = human_command(Project("debian", "p", "1", "gradle", "gradle test"))
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, check=False)
    assert done.returncode == 1
    assert human_count("gradle", done.stdout) == 2

def test_a_build_counts_usable_only_against_a_parsed_human_count() -> None:
    tests = TestReport(runner="cargo test", passed=5, failed=0)
    built = BuildEvent(repository="corpus/x", revision="HEAD", commit="0" * 40, rules_version=1, status="built",
                       usable=True, tests=tests)
    assert RealOutcome(built, human=5, seconds=1).usable
    assert not RealOutcome(built, human=7, seconds=1).usable  # 5 of 7: under 80 %
    unparsed = RealOutcome(built, human=0, seconds=1)
    assert not unparsed.usable and unparsed.outcome == "human count unparsed"
