"""Test-report parsers against what the tools print: counts equal to the tool's own summary, and the runs that
did not really run (collection errors, nothing executed) told apart from usable ones."""

from __future__ import annotations

import contextlib

from hypothesis import given
from hypothesis import strategies as st

from kiln.workers.common.reports import ReportError, cargo_test, junit, not_run_reason

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
    assert "src/lib.rs - Widget::new (line 40)" in {c.name for c in report.cases}
    quiet = cargo_test(CARGO_QUIET)
    assert (quiet.passed, quiet.failed, quiet.skipped) == (37, 0, 1)


@given(st.text())
def test_cargo_parser_takes_any_text(text: str) -> None:
    report = cargo_test(text)
    assert report.passed >= 0 and report.failed >= 0


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
    assert "failed to collect (e.g. tests.test_api)" in (not_run_reason(collected) or "")
    assert not_run_reason(junit(EMPTY, "pytest")) == "no test was executed"
    fine = junit(COLLECTION_ERROR.replace('message="collection failure"', 'message="boom"'), "pytest")
    assert not_run_reason(fine) is None


@given(st.text())
def test_junit_parser_raises_report_error_only(text: str) -> None:
    with contextlib.suppress(ReportError):
        junit(text, "pytest")
