"""Test-report parsers against what the tools print: counts equal to the tool's own summary, and the runs that
did not really run (collection errors, nothing executed) told apart from usable ones."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.workers.common.errors import ReportError
from kiln.workers.common.reports import (
    UNANNOUNCED,
    automake,
    cargo_test,
    coverage_py,
    gcov_json,
    go_cover_profile,
    go_test_json,
    istanbul,
    jest_json,
    junit,
    lcov,
    lint_findings,
    parse_results,
    per_test_lines,
    runner_summary,
    tap,
    unusable_reason,
)

# cargo test of a crate with a unit-test binary, an integration-test binary and doc tests.
CARGO_OUTPUT = """\
running 3 tests
test parse::tests::empty ... ok
test parse::tests::nested ... ok
test parse::tests::slow ... ignored, needs a large input

test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.00s

     Running tests/api.rs (target/debug/deps/api-6c9e2f1b)

running 2 tests
test round_trip ... ok
test rejects_garbage ... FAILED

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s

   Doc-tests widget

running 2 tests
test src/lib.rs - parse (line 12) ... ok
test src/lib.rs - Widget::new (line 40) ... ok

test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.20s
"""

# The same suite under ``cargo test -q``: dots, no names; only the summaries count.
CARGO_QUIET = """\
running 3 tests
..i
test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.00s

running 35 tests
...................................
test result: ok. 35 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.02s
"""


def test_cargo_counts_equal_the_summaries_doc_tests_included() -> None:
    report = cargo_test(CARGO_OUTPUT)
    assert (report.passed, report.failed, report.skipped) == (5, 1, 1)
    assert (report.summary_passed, report.summary_failed) == (5, 1) and unusable_reason(report) is None
    assert "src/lib.rs - Widget::new (line 40)" in {c.name for c in report.cases}
    quiet = cargo_test(CARGO_QUIET)  # -q: no names, only the summaries; not per-test results
    assert (quiet.passed, quiet.summary_passed, quiet.summary_failed) == (0, 37, 0)
    assert (unusable_reason(quiet) or ("", ""))[0] == "tests_did_not_run"


@given(st.text())
def test_cargo_parser_takes_any_text(text: str) -> None:
    # Text with no "test" in it holds no case and no summary: it adds nothing, before or after a real output.
    noise = text.replace("test", "")
    assert cargo_test(noise).cases == []
    report = cargo_test(noise + "\n" + CARGO_OUTPUT)
    assert (report.passed, report.failed, report.skipped, len(report.cases)) == (5, 1, 1, 7)
    assert cargo_test(CARGO_OUTPUT + "\n" + noise).model_dump() == cargo_test(CARGO_OUTPUT).model_dump()
    quiet = cargo_test(noise + "\n" + CARGO_QUIET + "\n" + noise)  # -q: only the summaries
    assert (quiet.summary_passed, quiet.summary_failed, len(quiet.cases)) == (37, 0, 0)


COLLECTION_ERROR = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1"
 failures="0" skipped="0" tests="1"><testcase classname="" name="tests.test_api" time="0.000"><error
 message="collection failure">ModuleNotFoundError: No module named 'hypothesis'</error></testcase>
<testcase classname="tests.test_core" name="test_ok" time="0.001"/></testsuite></testsuites>"""

EMPTY = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0"
 skipped="1" tests="1"><testcase classname="t" name="test_skipped" time="0"><skipped message="no db"/></testcase>
</testsuite></testsuites>"""


def test_collection_errors_and_empty_runs_did_not_run() -> None:
    collected = junit(COLLECTION_ERROR, "pytest")
    assert collected.passed == 1  # a usable-looking run, but a module never ran
    assert "failed to collect (e.g. tests.test_api)" in (unusable_reason(collected) or ("", ""))[1]
    assert unusable_reason(junit(EMPTY, "pytest")) == ("tests_did_not_run", "no test was executed")
    fine = junit(COLLECTION_ERROR.replace('message="collection failure"', 'message="boom"'), "pytest")
    assert unusable_reason(fine) is None


@given(st.text())
def test_junit_parser_raises_report_error_only(text: str) -> None:
    try:
        ET.fromstring(text)
    except ET.ParseError:
        with pytest.raises(ReportError):
            junit(text, "pytest")
    else:  # well-formed XML (rare in random text): one case per <testcase>, tallied
        report = junit(text, "pytest")
        assert report.passed + report.failed + report.skipped + report.errors == len(report.cases)


# A CTest run written with --output-junit: a failure, a skip (CTest's "disabled"), a pass.
CTEST = """<?xml version="1.0" encoding="UTF-8"?><testsuite name="Linux-c++" tests="3" failures="1" skipped="1">
<testcase name="parse_ok" classname="parse_ok" time="0.01" status="run"/>
<testcase name="parse_bad" classname="parse_bad" time="0.02" status="fail"><failure message="Failed"/></testcase>
<testcase name="slow" classname="slow" time="0" status="disabled"><skipped message="Disabled"/></testcase>
</testsuite>"""


def test_junit_counts_outcomes_and_keeps_failure_messages() -> None:
    report = junit(CTEST, "ctest")
    assert (report.runner, report.passed, report.failed, report.skipped, report.errors) == ("ctest", 1, 1, 1, 0)
    failed = next(c for c in report.cases if c.outcome == "failed")
    assert (failed.name, failed.message, failed.duration_s) == ("parse_bad.parse_bad", "Failed", 0.02)
    with pytest.raises(ReportError):
        junit("<testsuite><testcase", "pytest")


# go test -json: package events (no Test) and output lines are not cases; a test's last verdict counts.
GO_JSON = "\n".join(json.dumps(e) for e in [
    {"Action": "run", "Package": "example.com/calc", "Test": "TestAdd"},
    {"Action": "output", "Package": "example.com/calc", "Test": "TestAdd", "Output": "=== RUN TestAdd\n"},
    {"Action": "pass", "Package": "example.com/calc", "Test": "TestAdd", "Elapsed": 0.01},
    {"Action": "fail", "Package": "example.com/calc", "Test": "TestDiv", "Elapsed": 0.02},
    {"Action": "skip", "Package": "example.com/calc", "Test": "TestBig", "Elapsed": 0},
    {"Action": "fail", "Package": "example.com/calc", "Elapsed": 0.05},
]) + "\nFAIL\texample.com/calc\t0.05s\n"


def test_go_test_json_counts_test_events_only() -> None:
    report = go_test_json(GO_JSON)
    assert (report.passed, report.failed, report.skipped) == (1, 1, 1)
    assert {c.name for c in report.cases} == {"example.com/calc.TestAdd", "example.com/calc.TestDiv",
                                               "example.com/calc.TestBig"}
    with pytest.raises(ReportError):
        go_test_json('{"Action": "pass", "Test": ')


def test_automake_counts_expected_failures_as_passes_and_unexpected_passes_as_failures() -> None:
    text = "PASS: t/add\nXFAIL: t/known_bug\nFAIL: t/div\nXPASS: t/fixed_by_accident\nSKIP: t/net\nERROR: t/io\n" \
           "# TOTAL: 6\n"
    report = automake(text)
    assert (report.passed, report.failed, report.skipped, report.errors) == (2, 2, 1, 1)
    assert [c.name for c in report.cases] == ["t/add", "t/known_bug", "t/div", "t/fixed_by_accident", "t/net",
                                              "t/io"]


def test_tap_reads_node_test_output_with_directives_and_nesting() -> None:
    text = "TAP version 13\n# Subtest: math\n    ok 1 - adds\n    not ok 2 - divides\n1..2\n" \
           "ok 3 - slow # SKIP no time\nnot ok 4 - todo thing # TODO later\nok 5\nok 6 # skip offline\n"
    report = tap(text, "node test")
    assert (report.runner, report.passed, report.failed, report.skipped) == ("node test", 2, 1, 3)
    assert [c.name for c in report.cases] == ["adds", "divides", "slow", "todo thing", "unnamed", "unnamed"]


def test_coverage_py_json_is_made_relative_and_counts_executed_lines() -> None:
    doc = {"files": {"/work/calc.py": {"executed_lines": [1, 2, 4], "missing_lines": [5]},
                     "./pkg/util.py": {"executed_lines": [], "missing_lines": [1, 2]}}}
    cov = coverage_py(json.dumps(doc))
    assert (cov.lines_total, cov.lines_covered) == (6, 3)
    assert {f.path: f.covered_lines for f in cov.files} == {"calc.py": [1, 2, 4], "pkg/util.py": []}
    for bad in ("not json", json.dumps({"files": {"a.py": {"executed_lines": [1]}}})):
        with pytest.raises(ReportError):
            coverage_py(bad)


def test_go_cover_profile_covers_whole_blocks_and_strips_the_module() -> None:
    text = "mode: set\nexample.com/calc/add.go:3.20,5.2 1 1\nexample.com/calc/add.go:7.20,9.2 2 0\n" \
           "example.com/calc/add.go:10.1,10.5 0 1\n"
    cov = go_cover_profile(text, module="example.com/calc")
    (f,) = cov.files
    assert (f.path, f.executable_lines, f.covered_lines) == ("add.go", [3, 4, 5, 7, 8, 9], [3, 4, 5])
    with pytest.raises(ReportError):
        go_cover_profile("mode: set\nadd.go:3 1 1\n")


def test_gcov_json_skips_system_and_cmake_files() -> None:
    doc = {"files": [{"file": "/work/build/src/calc.c", "lines": [{"line_number": 3, "count": 2},
                                                                   {"line_number": 4, "count": 0}]},
                     {"file": "/usr/include/stdio.h", "lines": [{"line_number": 1, "count": 1}]},
                     {"file": "/work/build/CMakeFiles/x.c", "lines": [{"line_number": 1, "count": 1}]}]}
    cov = gcov_json(json.dumps(doc) + "\n\n", ("/work/build", "/work"))
    assert [(f.path, f.executable_lines, f.covered_lines) for f in cov.files] == [("src/calc.c", [3, 4], [3])]
    # meson compiles ../src/calc.c from its build directory: gcov names the file relative to that.
    meson = {"current_working_directory": "/work/build", "files": [{"file": "../src/calc.c", "lines": [
        {"line_number": 3, "count": 1}]}]}
    assert [f.path for f in gcov_json(json.dumps(meson), ("/work/build", "/work")).files] == ["src/calc.c"]
    with pytest.raises(ReportError):
        gcov_json(json.dumps({"files": [{"file": "a.c"}]}))


def test_lcov_reads_records_and_refuses_bad_lines() -> None:
    text = "TN:\nSF:/work/src/lib.rs\nDA:1,3\nDA:2,0\nDA:5,1.0\nend_of_record\nDA:9,1\nSF:src/main.rs\nDA:1,0\n" \
           "end_of_record\n"
    cov = lcov(text, "llvm-cov")
    assert {f.path: (f.executable_lines, f.covered_lines) for f in cov.files} == {
        "src/lib.rs": ([1, 2, 5], [1, 5]), "src/main.rs": ([1], [])}
    assert (cov.tool, cov.lines_total, cov.lines_covered) == ("llvm-cov", 4, 2)
    with pytest.raises(ReportError):
        lcov("SF:a.rs\nDA:x,1\n", "llvm-cov")


def test_istanbul_marks_a_line_covered_when_a_statement_on_it_ran() -> None:
    doc = {"/work/src/a.js": {"statementMap": {"0": {"start": {"line": 1}}, "1": {"start": {"line": 1}},
                                               "2": {"start": {"line": 3}}},
                              "s": {"0": 0, "1": 4, "2": 0}}}
    cov = istanbul(json.dumps(doc))
    assert [(f.path, f.executable_lines, f.covered_lines) for f in cov.files] == [("src/a.js", [1, 3], [1])]
    with pytest.raises(ReportError):
        istanbul(json.dumps({"a.js": {"s": {}}}))


def test_parse_results_picks_the_runner_file_and_its_coverage() -> None:
    lcov_text = b"SF:/work/src/lib.rs\nDA:1,1\nend_of_record\n"
    report = parse_results("cargo", 101, {"cargo-test.txt": CARGO_OUTPUT.encode(), "lcov.info": lcov_text})
    assert report is not None and (report.runner, report.failed) == ("cargo test", 1)
    assert report.coverage is not None and report.coverage.lines_covered == 1
    # No per-test output: a succeeding run is a report that is not itemised (never one pseudo-test), with the
    # runner's summary when it printed one; a failing run without any, or a missing command, is no report.
    whole = parse_results("make", 0, {"make-check.txt": b"cc -o t t.c\n./t\nTests passed: 349\n"})
    assert whole is not None and (whole.itemised, whole.cases, whole.summary_passed) == (False, [], 349)
    assert unusable_reason(whole) == ("tests_not_itemised", "the runner's per-test results could not be read; "
                                      "the runner's summary says 349 passed, 0 failed")
    silent = parse_results("make", 0, {})
    assert silent is not None and not silent.itemised and silent.summary_passed is None
    assert parse_results("make", 2, {}) is None and parse_results("make", 127, {}) is None
    assert parse_results("go", 0, {"go-test.json": b"not json\n"}) is not None  # non-JSON lines are output


def test_lint_findings_from_ruff_json_and_plain_lines() -> None:
    ruff = [{"filename": "/work/a.py", "location": {"row": 3, "column": 1}, "code": "F401",
             "message": "os imported but unused"}]
    (finding,) = lint_findings(json.dumps(ruff))
    assert (finding.path, finding.line, finding.column, finding.code) == ("a.py", 3, 1, "F401")
    plain = lint_findings("./src/x.c:10:5: warning: unused variable\nsrc/y.c:2: note\nnot a finding\n")
    assert [(f.path, f.line, f.column, f.message) for f in plain] == [
        ("src/x.c", 10, 5, "warning: unused variable"), ("src/y.c", 2, None, "note")]
    with pytest.raises(ReportError):
        lint_findings('[{"filename": "a.py"}]')


# What each runner prints or writes, cut from real runs: its per-test lines and its own summary.
MOCHA_XUNIT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="Mocha Tests" tests="4" failures="0" errors="1" skipped="1" timestamp="Thu" time="0.01">
<testcase classname="calc" name="adds" time="0.001"/>
<testcase classname="calc" name="subtracts" time="0"/>
<testcase classname="calc" name="divides" time="0"><failure>expected 1 to equal 2</failure></testcase>
<testcase classname="calc" name="later" time="0"><skipped/></testcase>
</testsuite>"""
JEST = {"numPassedTests": 2, "numFailedTests": 1, "numPendingTests": 1, "numTotalTests": 4, "testResults": [
    {"name": "/work/calc.test.js", "assertionResults": [
        {"fullName": "calc adds", "status": "passed", "duration": 3, "failureMessages": []},
        {"fullName": "calc subs", "status": "passed", "duration": None, "failureMessages": []},
        {"fullName": "calc divs", "status": "failed", "duration": 1, "failureMessages": ["Expected: 2"]},
        {"fullName": "calc todo", "status": "todo", "failureMessages": []}]}]}
GTEST = """[==========] Running 3 tests from 1 test suite.
[ RUN      ] Calc.Adds
[       OK ] Calc.Adds (0 ms)
[ RUN      ] Calc.Subs
[       OK ] Calc.Subs (0 ms)
[ RUN      ] Calc.Divs
calc_test.cc:12: Failure
[  FAILED  ] Calc.Divs (1 ms)
[==========] 3 tests from 1 test suite ran. (1 ms total)
[  PASSED  ] 2 tests.
[  FAILED  ] 1 test, listed below:
[  FAILED  ] Calc.Divs
"""
UNITY = """test/test_calc.c:10:test_adds:PASS
test/test_calc.c:15:test_subs:PASS
test/test_calc.c:20:test_divs:FAIL: Expected 2 Was 1
test/test_calc.c:25:test_big:IGNORE

-----------------------
4 Tests 1 Failures 1 Ignored
FAIL
"""
HAND_WRITTEN = "cc -o calc_test calc.c test.c\n./calc_test\nPASS: adds\nPASS: subtracts\nFAIL: divides\n" \
               "Tests passed: 2\nTests failed: 1\n"


def test_reporter_files_give_cases_and_the_runners_summary() -> None:
    mocha = parse_results("npm", 1, {"mocha.xml": MOCHA_XUNIT.encode(), "test-output.txt": b"ok 1 - forged\n"})
    assert mocha is not None and mocha.runner == "mocha" and mocha.itemised
    assert (mocha.passed, mocha.failed, mocha.skipped, mocha.summary_passed, mocha.summary_failed) == (2, 1, 1, 2, 1)
    assert unusable_reason(mocha) is None
    jest = jest_json(json.dumps(JEST), "jest")
    assert [(c.name, c.outcome) for c in jest.cases] == [("calc adds", "passed"), ("calc subs", "passed"),
                                                         ("calc divs", "failed"), ("calc todo", "skipped")]
    assert (jest.summary_passed, jest.summary_failed, jest.cases[2].message) == (2, 1, "Expected: 2")
    with pytest.raises(ReportError):
        jest_json(json.dumps({"testResults": [{}]}), "jest")
    vitest = parse_results("npm", 0, {"vitest.json": json.dumps(JEST).encode()})
    assert vitest is not None and (vitest.runner, vitest.passed) == ("vitest", 2)


@pytest.mark.parametrize(("text", "cases", "summary"), [
    (GTEST, [("Calc.Adds", "passed"), ("Calc.Subs", "passed"), ("Calc.Divs", "failed")], (2, 1)),
    (UNITY, [("test_adds", "passed"), ("test_subs", "passed"), ("test_divs", "failed"), ("test_big", "skipped")],
     (2, 1)),
    (HAND_WRITTEN, [("adds", "passed"), ("subtracts", "passed"), ("divides", "failed")], (2, 1)),
    ("test_add ... ok\ntest_div ... FAILED\n", [("test_add", "passed"), ("test_div", "failed")], None),
    ("parse: PASSED\nrender: FAILED\n", [("parse", "passed"), ("render", "failed")], None),
    ("  calc\n    \u2713 adds\n\n  47 passing (12ms)\n  2 failing\n", [], (47, 2)),
    ("Tests:       1 failed, 46 passed, 47 total\n", [], (46, 1)),
    ("\x1b[92m \x1b[0m\x1b[32m 17 passing\x1b[0m\x1b[90m (15ms)\x1b[0m\n", [], (17, 0)),  # mocha 1.21
    (" Test Files  3 passed (3)\n      Tests  1 failed | 46 passed (47)\n", [], (46, 1)),
    ("TAP version 13\nok 1 - a\nnot ok 2 - b\n# pass 1\n# fail 1\n", [("a", "passed"), ("b", "failed")], (1, 1)),
    ("\u2714 adds\n\u2139 tests 3\n\u2139 pass 3\n\u2139 fail 0\n", [], (3, 0)),
    ("  47 tests passed\n", [], (47, 0)),
    ("PASS: t/a\n# TOTAL: 1\n# PASS:  1\n# FAIL:  0\n", [("t/a", "passed")], (1, 0)),
    # automake's serial harness, one banner per directory (real: libgpg-error 1.46).
    ("PASS: cfg.sh\n==================\n1 test passed\n==================\nPASS: t-a\nFAIL: t-b\nPASS: t-c\n"
     "==================\n1 of 3 tests failed\n==================\n",
     [("cfg.sh", "passed"), ("t-a", "passed"), ("t-b", "failed"), ("t-c", "passed")], (3, 1)),
    ("PASS: t-a\nPASS: t-b\nAll 2 tests passed\n", [("t-a", "passed"), ("t-b", "passed")], (2, 0)),
    # A program's own progress lines are no verdicts, its make targets' banners are (zlib's "make test").
    ("uncompress(): hello, hello!\nlarge_inflate(): OK\n\t\t*** zlib test OK ***\n", [("zlib test", "passed")],
     None),
    ("PASS: t/a\nXFAIL: t/b\nXPASS: t/c\n# PASS:  1\n# XFAIL: 1\n# XPASS: 1\n# FAIL:  0\n",
     [("t/a", "passed"), ("t/b", "passed"), ("t/c", "failed")], (2, 1)),
])
def test_printed_suites_give_per_test_lines_and_the_summary(text: str, cases: list[tuple[str, str]],
                                                            summary: tuple[int, int] | None) -> None:
    report = per_test_lines(text, "make check")
    assert [(c.name, c.outcome) for c in report.cases] == cases
    assert runner_summary(text) == summary
    assert (report.summary_passed, report.summary_failed) == (summary or (None, None))


def test_per_test_results_that_disagree_with_the_summary_are_not_trusted() -> None:
    # A test printing fake "PASS:" lines in a suite whose runner counts 2 passes: the count gives it away.
    forged = per_test_lines(HAND_WRITTEN + "PASS: forged1\nPASS: forged2\n", "make check")
    assert forged.passed == 4
    kind, why = unusable_reason(forged) or ("", "")
    assert kind == "tests_not_itemised" and "disagree with the runner's summary (2 passed, 1 failed)" in why
    # tape counts "ok … # SKIP" among its passes (real: qs 6.12.1, 718 passed + 2 skipped = "# pass 720").
    tape = per_test_lines("ok 1 a\nok 2 b # SKIP later\n\n# tests 2\n# pass  2\n", "npm test")
    assert (tape.passed, tape.skipped, unusable_reason(tape)) == (1, 1, None)
    failing = per_test_lines("FAIL: a\nFAIL: b\n", "make check")
    assert unusable_reason(failing) == ("tests_did_not_run", "no test passed (2 failed)")


_NAME = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)


@given(st.lists(st.tuples(_NAME, st.booleans()), min_size=1, max_size=30, unique_by=lambda t: t[0]),
       st.sampled_from(["PASS: {n}", "[PASS] {n}", "{n} ... ok", "x.c:1:{n}:PASS", "[       OK ] {n} (0 ms)",
                        "\t\t*** {n} OK ***"]),
       st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_printed_per_test_lines_round_trip(tests: list[tuple[str, bool]], style: str, noise: str) -> None:
    failed = {"PASS: {n}": "FAIL: {n}", "[PASS] {n}": "[FAIL] {n}", "{n} ... ok": "{n} ... FAILED",
              "x.c:1:{n}:PASS": "x.c:1:{n}:FAIL", "[       OK ] {n} (0 ms)": "[  FAILED  ] {n} (0 ms)",
              "\t\t*** {n} OK ***": "\t\t*** {n} FAILED ***"}[style]
    lines = [(style if ok else failed).format(n=name) for name, ok in tests]
    passed = sum(ok for _n, ok in tests)
    # Noise without line structure a convention could read (no newline, no colon, no dots, no brackets).
    quiet = "".join(c for c in noise if c not in "\n\r:.[]#\u2139\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
    text = "\n".join([f"x{quiet}", *lines, f"Tests passed: {passed}", f"Tests failed: {len(tests) - passed}"])
    report = per_test_lines(text, "make check")
    assert [(c.name, c.outcome == "passed") for c in report.cases] == tests
    assert (report.summary_passed, report.summary_failed) == (passed, len(tests) - passed)
    assert unusable_reason(report) == (None if passed else ("tests_did_not_run",
                                                            f"no test passed ({len(tests)} failed)"))


@given(st.text())
def test_stdout_parsers_take_any_text(text: str) -> None:
    report = per_test_lines(text, "make check")
    assert report.passed + report.failed + report.skipped + report.errors == len(report.cases)
    summary = runner_summary(text)
    assert summary is None or min(summary) >= 0


@given(st.lists(st.tuples(st.text(min_size=1, max_size=20), st.sampled_from(["passed", "failed", "pending", "todo"])),
                max_size=20))
def test_jest_json_round_trips_every_assertion(results: list[tuple[str, str]]) -> None:
    doc = {"numPassedTests": sum(s == "passed" for _n, s in results),
           "numFailedTests": sum(s == "failed" for _n, s in results),
           "testResults": [{"assertionResults": [{"fullName": n, "status": s} for n, s in results]}]}
    report = jest_json(json.dumps(doc), "jest")
    assert [c.outcome for c in report.cases] == [{"pending": "skipped", "todo": "skipped"}.get(s, s)
                                                 for _n, s in results]
    assert (report.passed, report.failed) == (report.summary_passed, report.summary_failed)


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=6))
def test_automake_serial_banners_sum_over_directories(dirs: list[tuple[int, int]]) -> None:
    """Per directory the serial harness prints "All N tests passed", "1 test passed", or "F of N tests failed"."""
    banners = [(f"All {n} tests passed" if n > 1 else "1 test passed") if failed == 0 else
               f"{min(failed, n)} of {n} tests failed" for n, failed in dirs]
    text = "".join(f"make[1]: Entering directory\n====\n{b}\n====\n" for b in ["All 2 tests passed", *banners])
    bad = sum(min(f, n) for n, f in dirs)
    assert runner_summary(text) == (2 + sum(n for n, _f in dirs) - bad, bad)


def test_xunit_printed_among_the_output_is_read() -> None:
    """mocha < 2.2 ignores the xunit reporter's output option and prints the XML (real: etag's mocha 1.21)."""
    printed = "> etag@1.8.1 test\n" + MOCHA_XUNIT + "\n"
    report = parse_results("npm", 0, {"test-output.txt": printed.encode()})
    assert report is not None and report.runner == "mocha" and report.itemised
    assert (report.passed, report.failed, report.summary_passed) == (2, 1, 2)


# zlib 1.2.13's "make check" (= "make test": its targets teststatic, testshared and test64), cut from a real run in
# kiln's image: each target prints its program's progress, then one banner, its only verdict.
ZLIB_PROGRESS = ("hello world\nzlib version 1.2.13 = 0x12d0, compile flags = 0xa9\nuncompress(): hello, hello!\n"
                 "gzread(): hello, hello!\ngzgets() after gzseek:  hello!\ninflate(): hello, hello!\n"
                 "large_inflate(): OK\nafter inflateSync(): hello, hello!\ninflate with dictionary: hello, hello!\n")


def test_zlib_make_test_banners_are_its_per_test_results() -> None:
    printed = "".join(f"{ZLIB_PROGRESS}\t\t*** zlib {kind}test OK ***\n" for kind in ("", "shared ", "64-bit "))
    report = parse_results("autotools", 0, {"make-check.txt": printed.encode()})
    assert report is not None and report.itemised and report.runner == "make check"
    assert [(c.name, c.outcome) for c in report.cases] == [
        ("zlib test", "passed"), ("zlib shared test", "passed"), ("zlib 64-bit test", "passed")]
    assert unusable_reason(report) is None
    # A failing target stops make: the banners so far are the results, the failure among them.
    failing = (f"{ZLIB_PROGRESS}\t\t*** zlib test OK ***\n{ZLIB_PROGRESS}\t\t*** zlib shared test FAILED ***\n"
               "make: *** [Makefile:104: testshared] Error 1\n")
    report = parse_results("autotools", 2, {"make-check.txt": failing.encode()})
    assert report is not None and [(c.name, c.outcome) for c in report.cases] == [
        ("zlib test", "passed"), ("zlib shared test", "failed")]


def test_mocha_1_xunit_counts_each_failure_once() -> None:
    """mocha 1.21's xunit reporter writes the failure count into both ``failures`` and ``errors`` (real:
    merge-descriptors 1.0.1 on Node 20, 5 passed and 3 failed); mocha 10 writes it into ``errors`` only."""
    cases = "".join(f'<testcase classname="merge" name="t{i}" time="0">{"<failure>x</failure>" if i < 3 else ""}'
                    "</testcase>" for i in range(8))
    printed = f'<testsuite name="Mocha Tests" tests="8" failures="3" errors="3" skipped="0">{cases}</testsuite>\n'
    report = parse_results("npm", 1, {"test-output.txt": printed.encode()})
    assert report is not None and (report.passed, report.failed) == (5, 3)
    assert (report.summary_passed, report.summary_failed) == (5, 3) and unusable_reason(report) is None
    mocha10 = junit(printed.replace('failures="3"', 'failures="0"'), "mocha", summary=True)
    assert (mocha10.summary_passed, mocha10.summary_failed) == (5, 3)


# trybuild inside one libtest test (real: a proc-macro crate's tests/ui.rs): its own "test … ... ok" lines go
# straight to the terminal, between libtest's "running 1 test" and that test's own line.
TRYBUILD = """\
running 2 tests
test tests::adds ... ok
test tests::subtracts ... ok

test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s

     Running tests/ui.rs (target/debug/deps/ui-0a1b2c3d)

running 1 test
    Checking calc-tests v0.0.0 (/work/target/tests/trybuild/calc)
    Finished `dev` profile [unoptimized + debuginfo] target(s) in 0.51s


test tests/ui/pass.rs [should pass] ... ok
test tests/ui/missing-arg.rs [should fail to compile] ... ok
test tests/ui/bad-type.rs [should fail to compile] ... ok


test ui ... ok

test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 2.37s
"""


def test_a_nested_harness_inside_one_libtest_test_is_no_case_of_its_own() -> None:
    report = cargo_test(TRYBUILD)
    assert [c.name for c in report.cases] == ["tests::adds", "tests::subtracts", "ui"]
    assert (report.passed, report.summary_passed, report.summary_failed) == (3, 3, 0)
    assert unusable_reason(report) is None
    # Doc tests and workspaces keep every line: the lines equal what libtest said it runs.
    assert len(cargo_test(CARGO_OUTPUT).cases) == 7


# The same run with one test thread (one CPU: kiln's exec runners): libtest announces "test ui ... " before the test
# runs, and its verdict comes on a line of its own after the harness's lines (real: the exec stage's run of
# tests/workers/builder/more_systems.py's nested-harness project).
TRYBUILD_SEQUENTIAL = TRYBUILD.replace("\n\ntest tests/ui/pass.rs", "test ui ... \ntest tests/ui/pass.rs").replace(
    "\n\n\ntest ui ... ok\n", "\n\nok\n")


def test_libtest_announcing_a_test_before_its_verdict() -> None:
    report = cargo_test(TRYBUILD_SEQUENTIAL)
    assert "test ui ... \n" in TRYBUILD_SEQUENTIAL and "test ui ... ok" not in TRYBUILD_SEQUENTIAL
    assert [(c.name, c.outcome) for c in report.cases] == [("tests::adds", "passed"), ("tests::subtracts", "passed"),
                                                           ("ui", "passed")]
    assert unusable_reason(report) is None
    # Output the test writes itself lands right after the announcement, the verdict on the next line (real: a
    # failing add() writing "test tests::adds ... ok" to stderr).
    failing = ("running 2 tests\ntest tests::adds ... test tests::adds ... ok\nFAILED\ntest tests::multiplies ... ok\n"
               "\ntest result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n")
    forged = cargo_test(failing)
    assert [(c.name, c.outcome) for c in forged.cases] == [("tests::adds", "passed"), ("tests::adds", "failed"),
                                                           ("tests::multiplies", "passed")]
    assert (unusable_reason(forged) or ("", ""))[0] == "tests_not_itemised"
    # A verdict printed by the code under test before libtest's own: libtest's then has no test waiting for it,
    # and still counts.
    early = failing.replace("test tests::adds ... test tests::adds ... ok\nFAILED",
                            "test tests::adds ... \nok\nFAILED")
    assert [c.name for c in cargo_test(early).cases] == ["tests::adds", UNANNOUNCED, "tests::multiplies"]
    assert (unusable_reason(cargo_test(early)) or ("", ""))[0] == "tests_not_itemised"
    # A test announced and never given a verdict (its process ended) failed.
    cut = cargo_test("running 1 test\ntest tests::adds ... ")
    assert [(c.name, c.outcome) for c in cut.cases] == [("tests::adds", "error")]


@pytest.mark.parametrize(("forged", "why"), [
    # Lines with libtest's names are libtest's: printed by the code under test they disagree with the summary.
    ("test tests::forged ... ok\n", "a libtest name among the nested lines"),
    ("test ui ... ok\n", "the failing test repeated as passing"),
    # A nested harness's lines with one libtest-named line too many: no selection comes to N, all of them count.
    ("test tests/ui/x.rs ... ok\ntest tests::forged ... ok\n", "a mix"),
])
def test_forged_lines_in_a_nested_harness_still_disagree(forged: str, why: str) -> None:
    failing = TRYBUILD.replace("test ui ... ok", "test ui ... FAILED").replace(
        "test result: ok. 1 passed; 0 failed", "test result: FAILED. 0 passed; 1 failed")
    report = cargo_test(failing.replace("test tests/ui/pass.rs", forged + "test tests/ui/pass.rs"))
    assert (unusable_reason(report) or ("", ""))[0] == "tests_not_itemised", why


def test_nested_shaped_lines_can_neither_add_a_pass_nor_hide_a_failure() -> None:
    failing = TRYBUILD.replace("test ui ... ok", "test ui ... FAILED").replace(
        "test result: ok. 1 passed; 0 failed", "test result: FAILED. 0 passed; 1 failed")
    forged = "".join(f"test tests/ui/forged{i}.rs [should pass] ... ok\n" for i in range(20))
    report = cargo_test(failing.replace("\ntest ui ... FAILED", f"\n{forged}test ui ... FAILED"))
    assert {c.name: c.outcome for c in report.cases}["ui"] == "failed"
    assert (report.passed, report.failed) == (2, 1) and unusable_reason(report) is None
    # Outside a binary's block nothing is dropped: a forged line there counts, and disagrees.
    assert (unusable_reason(cargo_test(TRYBUILD + "test tests/ui/z.rs ... ok\n")) or ("", ""))[0] == \
        "tests_not_itemised"


def test_the_convention_that_agrees_with_the_summary_wins_over_one_with_more_lines() -> None:
    """automake's serial harness counts each test program once; a GoogleTest program among them prints a line per
    case (real: audiofile 0.3.6, "All 35 tests passed" over 217 lines): the harness's lines agree with its summary and
    are the tests. Lines agreeing with no summary still lose to the most lines, and stay untrusted."""
    gtest = "".join(f"[       OK ] Suite.case{i} (0 ms)\n" for i in range(5))
    text = f"{gtest}PASS: gtest_program\nPASS: writeraw\n===================\nAll 2 tests passed\n"
    report = per_test_lines(text, "make check")
    assert [c.name for c in report.cases] == ["gtest_program", "writeraw"] and unusable_reason(report) is None
    forged = per_test_lines(text + "PASS: forged\n", "make check")
    assert unusable_reason(forged) is not None and forged.passed == 5
