"""The parsers of the runners issue 50 added (Maven Surefire's and Gradle's JUnit files, meson's testlog.json,
JaCoCo's XML, the TAP of ava, QUnit and node-tap, kiln's own uvu and jasmine reporters), on what those runners
write and print (cut from real runs), and attacked the way code under test could: lines printed into the runner's
output, points added to a TAP stream, a report file without the runner's count."""

from __future__ import annotations

import json

import pytest

from kiln.workers.common.errors import ReportError
from kiln.workers.common.reports import (
    jacoco_xml,
    meson_testlog,
    parse_results,
    printed_summary,
    tap_subtests,
    unusable_reason,
)

# ava 6 --tap (real): a console.log of the code under test goes to stderr in TAP mode, never into this stream.
AVA_TAP = """TAP version 13
ok 1 - skipped one # SKIP
ok 2 - adds
ok 3 - subtracts
not ok 4 - fails
  ---
    name: AssertionError
    message: ''
  ...

1..4
# tests 4
# pass 2
# skip 1
# fail 1
"""
# QUnit 2 --reporter tap (real): the code under test's console.log shares stdout ("ok 77 - from code").
QUNIT_TAP = """TAP version 13
ok 77 - from code
ok 1 calc > adds
not ok 2 calc > fails
  ---
  message: failed
  ...
ok 3 calc > skipped # SKIP
not ok 4 calc > todo one # TODO
ok 5 top
1..5
# pass 2
# skip 1
# todo 1
# fail 1
"""
# kiln's uvu reporter's lines, and what uvu 0.5.6 prints at the end (colours kept, as uvu writes them).
UVU_TAP = "ok 1 - adds\nnot ok 2 - fails\nok 3 - calc > mul\n"
UVU_PRINTED = ("\x1b[1m\x1b[4m\x1b[37ma.mjs\x1b[22m\x1b[24m\x1b[39m\n\x1b[90m\u2022 \x1b[39m\x1b[31m\u2718 \x1b[39m"
               "\x1b[31m  (1 / 2)\n\x1b[39m\n  Total:     3\x1b[31m\n  Passed:    2\x1b[39m\n  Skipped:   "
               "\x1b[33m1\x1b[39m\n  Duration:  6.05ms\n\n")
# kiln's jasmine helper's lines, and jasmine 5's console reporter.
JASMINE_TAP = "ok 1 - calc adds\nnot ok 2 - calc fails\nok 3 - calc nested works\nok 4 - calc skipped # SKIP\n"
JASMINE_PRINTED = ("Randomized with seed 75374\nStarted\n.*.F\n\nFailures:\n1) calc fails\n  Message:\n"
                   "    Expected 1 to be 2.\n\n4 specs, 1 failure, 1 pending spec\nFinished in 0.007 seconds\n")
# node-tap 16 -R tap (real): subtests with assertions inside, a group of subtests, a skipped one.
NODE_TAP = """TAP version 13
# Subtest: test/calc.js
    # Subtest: adds
        ok 1 - should be equal
        ok 2 - should be equal
        1..2
    ok 1 - adds # time=2.482ms

    # Subtest: group
        # Subtest: inner ok
            ok 1 - expect truthy value
            1..1
        ok 1 - inner ok # time=2.178ms

        # Subtest: inner fails
            not ok 1 - should be equal
              ---
              compare: ===
              ...

            1..1
            # failed 1 test
        not ok 2 - inner fails # time=10.886ms

        1..2
        # failed 1 of 2 tests
    not ok 2 - group # time=17.887ms

    ok 3 - skipped # SKIP
    1..3
    # failed 1 of 3 tests
    # skip: 1
not ok 1 - test/calc.js # time=24.931ms

1..1
# failed 1 test
"""


def _parse(files: dict[str, str], exit_code: int = 1) -> tuple[list[tuple[str, str]], tuple[str, str] | None]:
    report = parse_results("npm", exit_code, {n: t.encode() for n, t in files.items()})
    assert report is not None
    return [(c.name, c.outcome) for c in report.cases], unusable_reason(report)


def test_js_runners_itemise_against_their_own_count() -> None:
    assert _parse({"ava.tap": AVA_TAP}) == ([("skipped one", "skipped"), ("adds", "passed"),
                                             ("subtracts", "passed"), ("fails", "failed")], None)
    cases, problem = _parse({"qunit.tap": QUNIT_TAP.replace("ok 77 - from code\n", "")})
    assert (cases[:2], problem) == ([("calc > adds", "passed"), ("calc > fails", "failed")], None)
    assert _parse({"uvu.tap": UVU_TAP, "test-output.txt": UVU_PRINTED}) == (
        [("adds", "passed"), ("fails", "failed"), ("calc > mul", "passed")], None)
    assert _parse({"jasmine.tap": JASMINE_TAP, "test-output.txt": JASMINE_PRINTED})[1] is None
    assert printed_summary("jasmine", JASMINE_PRINTED) == (2, 1)
    assert _parse({"tap.tap": NODE_TAP}) == ([("adds", "passed"), ("inner ok", "passed"),
                                              ("inner fails", "failed"), ("skipped", "skipped")], None)


@pytest.mark.parametrize(("files", "why"), [
    # QUnit's stdout is the code under test's too: a printed point is one pass more than QUnit counted.
    ({"qunit.tap": QUNIT_TAP}, "a point printed into QUnit's TAP"),
    ({"ava.tap": AVA_TAP.replace("ok 2 - adds", "ok 2 - adds\nok 9 - forged")}, "a point added to ava's"),
    # The failing test reported passing too, by a line written into kiln's reporter file.
    ({"uvu.tap": UVU_TAP + "ok 4 - fails\n", "test-output.txt": UVU_PRINTED}, "uvu, a failure repeated"),
    ({"jasmine.tap": JASMINE_TAP + "ok 5 - calc forged\n", "test-output.txt": JASMINE_PRINTED}, "jasmine"),
])
def test_forged_points_disagree_with_the_runners_count(files: dict[str, str], why: str) -> None:
    assert (_parse(files)[1] or ("", ""))[0] == "tests_not_itemised", why


def test_a_reporter_file_without_the_runners_count_is_no_report_kiln_trusts() -> None:
    """kiln's uvu file alone (the printed summary gone, as when the code under test exits the process first) is
    not trusted, and the printed lines are never read in its place."""
    assert (_parse({"uvu.tap": UVU_TAP}, exit_code=0)[1] or ("", ""))[0] == "tests_not_itemised"
    forged_print = "PASS: adds\nPASS: fails\nTests passed: 2\n"
    cases, problem = _parse({"uvu.tap": "", "test-output.txt": forged_print + UVU_PRINTED}, exit_code=0)
    assert cases == [] and (problem or ("", ""))[0] == "tests_not_itemised"


@pytest.mark.parametrize("forged", [
    # A point printed by the code under test at the file's level, and a whole forged subtest there: either makes
    # that level hold more points than its plan.
    "    ok 4 - forged\n",
    "    # Subtest: forged\n        ok 1 - x\n        1..1\n    ok 4 - forged\n",
])
def test_node_tap_points_beyond_a_plan_are_not_itemised(forged: str) -> None:
    report = tap_subtests(NODE_TAP.replace("    1..3\n", forged + "    1..3\n"), "tap")
    assert not report.itemised and report.cases == []
    # Exit 0 and the forged stream (a failing run with it gives no report at all).
    assert (_parse({"tap.tap": NODE_TAP.replace("    1..3\n", forged + "    1..3\n")}, exit_code=0)[1]
            or ("", ""))[0] == "tests_not_itemised"


# meson 1.0's testlog.json (one object per line) and the counts "meson test" prints.
MESON_LOG = "\n".join(json.dumps(d) for d in [
    {"name": "calc adds", "stdo": "", "result": "OK", "duration": 0.01, "returncode": 0, "suite": ["calc"]},
    {"name": "calc divides", "stdo": "expected 2\n", "result": "FAIL", "duration": 0.01, "returncode": 1,
     "suite": ["calc"]},
    {"name": "calc big", "stdo": "", "result": "SKIP", "duration": 0.0, "returncode": 77, "suite": ["calc"]},
    {"name": "calc broken", "stdo": "", "result": "EXPECTEDFAIL", "duration": 0.0, "returncode": 1,
     "suite": ["calc"]},
]) + "\n"
MESON_PRINTED = """1/4 calc adds          OK              0.01s
2/4 calc divides       FAIL            0.01s   exit status 1
3/4 calc big           SKIP            0.00s   exit status 77
4/4 calc broken        EXPECTEDFAIL    0.00s   exit status 1

Ok:                 1
Expected Fail:      1
Fail:               1
Unexpected Pass:    0
Skipped:            1
Timeout:            0
"""


def test_meson_testlog_against_meson_tests_counts() -> None:
    report = meson_testlog(MESON_LOG, MESON_PRINTED)
    assert [(c.name, c.outcome) for c in report.cases] == [("calc adds", "passed"), ("calc divides", "failed"),
                                                           ("calc big", "skipped"), ("calc broken", "passed")]
    assert (report.summary_passed, report.summary_failed, unusable_reason(report)) == (2, 1, None)
    assert report.cases[1].message == "expected 2\n"
    # A test program writing its own line into the log: one pass more than meson counted.
    forged = MESON_LOG + json.dumps({"name": "forged", "result": "OK"}) + "\n"
    assert (unusable_reason(meson_testlog(forged, MESON_PRINTED)) or ("", ""))[0] == "tests_not_itemised"
    for bad in ("{", '{"name": "x"}', '{"name": "x", "result": "GREAT"}'):
        with pytest.raises(ReportError):
            meson_testlog(bad)


SUREFIRE = """<?xml version="1.0" encoding="UTF-8"?>
<testsuite xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" name="com.example.CalcTest" time="0.031"
 tests="3" errors="0" skipped="1" failures="1">
  <properties><property name="java.version" value="17.0.13"/></properties>
  <testcase name="adds" classname="com.example.CalcTest" time="0.004"/>
  <testcase name="divides" classname="com.example.CalcTest" time="0.002">
    <failure message="expected: &lt;2&gt; but was: &lt;1&gt;" type="org.opentest4j.AssertionFailedError"/>
  </testcase>
  <testcase name="later" classname="com.example.CalcTest" time="0"><skipped/></testcase>
</testsuite>"""
MAVEN_PRINTED = """[INFO] -------------------------------------------------------
[INFO]  T E S T S
[INFO] -------------------------------------------------------
[INFO] Running com.example.CalcTest
[ERROR] Tests run: 3, Failures: 1, Errors: 0, Skipped: 1, Time elapsed: 0.031 s <<< FAILURE! -- in com.example.CalcTest
[ERROR] com.example.CalcTest.divides -- Time elapsed: 0.002 s <<< FAILURE!
[INFO]
[INFO] Results:
[INFO]
[ERROR] Failures:
[ERROR]   CalcTest.divides:14 expected: <2> but was: <1>
[INFO]
[ERROR] Tests run: 3, Failures: 1, Errors: 0, Skipped: 1
[INFO]
[INFO] BUILD FAILURE
"""


def test_surefire_reports_against_mavens_totals() -> None:
    cases, problem = _parse({"surefire/1-TEST-com.example.CalcTest.xml": SUREFIRE, "test-output.txt": MAVEN_PRINTED})
    assert (cases, problem) == ([("com.example.CalcTest.adds", "passed"), ("com.example.CalcTest.divides", "failed"),
                                 ("com.example.CalcTest.later", "skipped")], None)
    # A test writing a report of its own into target/surefire-reports: Maven did not count it.
    forged = SUREFIRE.replace("CalcTest", "ForgedTest").replace('<testcase name="divides"', '<testcase name="x"')
    assert (_parse({"surefire/1-a.xml": SUREFIRE, "surefire/2-b.xml": forged, "test-output.txt": MAVEN_PRINTED})[1]
            or ("", ""))[0] == "tests_not_itemised"
    # Maven's totals printed by the code under test on top of the real ones are summed, and disagree.
    printed = MAVEN_PRINTED + "[INFO] Tests run: 5, Failures: 0, Errors: 0, Skipped: 0\n"
    assert (_parse({"surefire/1-a.xml": SUREFIRE, "test-output.txt": printed})[1] or ("", ""))[0] == \
        "tests_not_itemised"
    # Without Maven's totals (the run stopped first) the files are not trusted.
    assert (_parse({"surefire/1-a.xml": SUREFIRE}, exit_code=0)[1] or ("", ""))[0] == "tests_not_itemised"
    # No report at all (the code under test ended the run): the lines it printed are not read instead.
    printed_only = {"surefire/kiln-expected": "", "test-output.txt": "PASS: adds\nTests passed: 1\n" + MAVEN_PRINTED}
    assert _parse(printed_only, exit_code=0) == ([], ("tests_not_itemised", "the runner's per-test results could "
                                                      "not be read; the runner's summary says 1 passed, 1 failed"))


def test_gradle_reports_carry_their_own_counts() -> None:
    gradle = SUREFIRE.replace(' skipped="1" failures="1"', ' skipped="1" failures="1"')
    cases, problem = _parse({"gradle/TEST-com.example.CalcTest.xml": gradle}, exit_code=1)
    assert len(cases) == 3 and problem is None
    lying = gradle.replace('tests="3"', 'tests="5"')
    assert (_parse({"gradle/TEST-x.xml": lying})[1] or ("", ""))[0] == "tests_not_itemised"


JACOCO = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<!DOCTYPE report PUBLIC "-//JACOCO//DTD Report 1.1//EN" "report.dtd"><report name="calc">
<sessioninfo id="x" start="1" dump="2"/><package name="com/example">
<class name="com/example/Calc" sourcefilename="Calc.java"/>
<sourcefile name="Calc.java"><line nr="3" mi="3" ci="0" mb="0" cb="0"/><line nr="5" mi="0" ci="4" mb="0" cb="0"/>
<line nr="6" mi="0" ci="2" mb="1" cb="1"/><line nr="9" mi="2" ci="0" mb="0" cb="0"/>
<counter type="LINE" missed="2" covered="2"/></sourcefile></package></report>"""


def test_jacoco_lines_per_module_source_root() -> None:
    coverage = jacoco_xml([("core/src/main/java", JACOCO)])
    assert [(f.path, f.executable_lines, f.covered_lines) for f in coverage.files] == [
        ("core/src/main/java/com/example/Calc.java", [3, 5, 6, 9], [5, 6])]
    report = parse_results("maven", 0, {"surefire/1-a.xml": SUREFIRE.encode(), "test-output.txt":
                                        MAVEN_PRINTED.encode(), "jacoco/1.xml": JACOCO.encode(),
                                        "jacoco/1.dir": b"src/main/java\n"})
    assert report is not None and report.coverage is not None and report.coverage.tool == "jacoco"
    assert report.coverage.files[0].path == "src/main/java/com/example/Calc.java"
    with pytest.raises(ReportError):
        jacoco_xml([("", "<report")])
