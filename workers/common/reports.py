"""Parsers from each ecosystem's test and coverage output to kiln's unified ``TestReport`` / ``CoverageReport``.

Test results: JUnit XML (pytest, CTest, mocha's xunit reporter), ``go test -json``, ``cargo test`` text, jest's
and vitest's JSON, TAP (``node --test`` to a file, ava, tap), and the lines make-driven suites and test binaries
print per test (automake, GoogleTest, Unity, ``PASS name`` / ``name ... ok`` / ``*** name OK ***``), each with
the runner's own summary line when it prints one (``47 passing``, ``Tests passed: 349``, ``# pass 3``, ``[  PASSED
] 12 tests``). A run whose per-test results cannot be read is a report with ``itemised=False`` (and the summary's
counts), never one pseudo-test. Coverage: coverage.py JSON, Go cover profiles, gcov JSON (GCC), istanbul JSON
(c8/nyc), lcov (llvm-cov, for Rust). Every parser raises ``ReportError`` on malformed input and nothing else; paths
are made relative to the project root.

What is trusted: files a runner's reporter writes into the reports directory (JUnit, JSON, ``go test -json``) are
preferred; stdout is parsed only where kiln cannot choose a reporter (make suites, test binaries, ``npm test``
scripts kiln cannot re-run with a reporter). The judged code shares both with the runner, so it could print or
write fake lines: a report counts only when its per-test results agree with the runner's summary, and the exit
status (measured outside the sandbox) stays the arbiter of a failed run (``exec.ops.checked_report``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from typing import Any, Literal

from kiln.schemas.builder import FailureClass
from kiln.schemas.exec import LintFinding
from kiln.schemas.reports import CoverageReport, FileCoverage, TestCaseResult, TestReport
from kiln.workers.common.errors import ReportError

Outcome = Literal["passed", "failed", "skipped", "error"]


def _relative(path: str, roots: Iterable[str]) -> str:
    for root in roots:
        root = root.rstrip("/") + "/"
        if path.startswith(root):
            return path[len(root):]
    return path[2:] if path.startswith("./") else path


def tally(runner: str, cases: list[TestCaseResult], summary: tuple[int, int] | None = None) -> TestReport:
    """The counts of ``cases``; ``summary``: (passed, failed) by the runner's own summary line, when it has one."""
    count = {o: sum(1 for c in cases if c.outcome == o) for o in ("passed", "failed", "skipped", "error")}
    return TestReport(runner=runner, passed=count["passed"], failed=count["failed"], skipped=count["skipped"],
                      errors=count["error"], cases=cases, summary_passed=summary[0] if summary else None,
                      summary_failed=summary[1] if summary else None)


def coverage_report(tool: str, files: dict[str, tuple[set[int], set[int]]]) -> CoverageReport:
    entries = [FileCoverage(path=path, executable_lines=sorted(exe), covered_lines=sorted(cov & exe))
               for path, (exe, cov) in sorted(files.items()) if exe]
    return CoverageReport(tool=tool, files=entries, lines_total=sum(len(f.executable_lines) for f in entries),
                          lines_covered=sum(len(f.covered_lines) for f in entries))


def junit(xml_text: str, runner: str, summary: bool = False) -> TestReport:
    """``summary``: the root suite's own counts are the runner's summary (mocha's xunit reporter writes them)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ReportError(f"JUnit XML does not parse: {e}") from None
    cases = []
    for case in root.iter("testcase"):
        name = ".".join(x for x in (case.get("classname"), case.get("name")) if x) or "unnamed"
        outcome, message = "passed", ""
        for tag, kind in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = kind, (node.get("message") or node.text or "")[:2000]
                break
        try:
            duration = float(case.get("time") or 0)
        except ValueError:
            duration = None
        cases.append(TestCaseResult(name=name, outcome=outcome, duration_s=duration, message=message))
    return tally(runner, cases, _suite_summary(root) if summary else None)


def _suite_summary(root: ET.Element) -> tuple[int, int] | None:
    """(passed, failed) from the ``tests``/``failures``/``errors``/``skipped`` attributes of the root suite. mocha's
    xunit reporter writes its failure count as ``errors``, and as ``failures`` too before mocha 2 (mocha 10 writes
    0 there; real: merge-descriptors' mocha 1.21, tests="8" failures="3" errors="3" for 5 passed, 3 failed): the
    same count twice is counted once."""
    try:
        total, failures, errors, skipped = (int(root.get(a) or 0) for a in ("tests", "failures", "errors",
                                                                             "skipped"))
    except ValueError:
        return None
    failed = errors if failures in (0, errors) else failures + errors
    return (total - failed - skipped, failed) if root.get("tests") is not None else None


def go_test_json(text: str) -> TestReport:
    cases: dict[str, TestCaseResult] = {}
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError as e:
            raise ReportError(f"go test -json line does not parse: {e}") from None
        test, action = event.get("Test"), event.get("Action")
        if not isinstance(test, str) or action not in ("pass", "fail", "skip"):
            continue
        name = f"{event.get('Package', '')}.{test}"
        outcome = {"pass": "passed", "fail": "failed", "skip": "skipped"}[action]
        cases[name] = TestCaseResult(name=name, outcome=outcome, duration_s=event.get("Elapsed"))
    return tally("go test", list(cases.values()))


_CARGO_TEST = re.compile(r"^test (.+?) \.\.\. ?(.*)$")
_CARGO_VERDICT = re.compile(r"(ok|FAILED|ignored)(?:, .*)?")
_CARGO_SUMMARY = re.compile(r"^test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", re.MULTILINE)
_CARGO_RUNNING = re.compile(r"running (\d+) tests?")
# The names libtest gives its own tests: a path of Rust identifiers (``tests::adds``, ``r#type``), or a doc test's
# ``<file> - <item> (line N)`` with rustdoc's suffixes (`` - compile fail``, `` - should panic``, `` - compile``).
_LIBTEST_NAME = re.compile(r"(?:r#)?\w+(?:::(?:r#)?\w+)*|\S.* - .*\(line \d+\)(?: - [a-z ]+)?")
_CARGO_OUTCOME: dict[str, Outcome] = {"ok": "passed", "FAILED": "failed", "ignored": "skipped"}
UNANNOUNCED = "(a verdict of no test libtest announced)"


def cargo_test(text: str) -> TestReport:
    """One case per test libtest reports (doc tests' names have spaces); the ``test result:`` lines of every test
    binary, summed, are the summary they are checked against (``-q`` prints no names: not itemised).

    libtest prints ``test NAME ... ok`` once a test is done when it runs tests in parallel; running one at a time (one
    CPU, or ``--test-threads=1``) it prints ``test NAME ... `` first and the verdict when the test ends, after
    whatever the test wrote to the terminal itself: on the same line, or on a line of its own. A verdict line with
    no test waiting for one is a case of its own (``UNANNOUNCED``), so a verdict printed by the code under test
    before libtest's own still leaves a case too many.

    A nested harness inside one libtest test (trybuild runs its UI cases inside one ``#[test]``, and prints ``test
    tests/ui/x.rs [should pass] ... ok`` per case, straight to the terminal) adds lines libtest did not print. Per
    test binary (``running N tests`` to its ``test result:``), when the cases outnumber the N tests libtest said it
    runs and exactly N of them carry a name libtest gives (``_LIBTEST_NAME``), the others are the nested harness's
    and no case. Anything else stays a case: a printed line with a libtest name, or lines that do not come down to
    exactly N that way, still disagree with the summary (and dropping lines never adds a pass)."""
    summaries = [tuple(int(x) for x in m.groups()) for m in _CARGO_SUMMARY.finditer(text)]
    summary = (sum(s[0] for s in summaries), sum(s[1] for s in summaries)) if summaries else None
    kept: list[TestCaseResult] = []
    block: list[TestCaseResult] = []
    waiting: list[str] = []  # tests announced and not yet given a verdict, the latest last
    declared: int | None = None

    def case(name: str, verdict: str) -> None:
        block.append(TestCaseResult(name=name, outcome=_CARGO_OUTCOME[verdict]))

    def close() -> None:
        # A test announced and never given a verdict (its process ended) failed.
        block.extend(TestCaseResult(name=name, outcome="error", message="no verdict") for name in waiting)
        waiting.clear()
        own = [c for c in block if c.name == UNANNOUNCED or _LIBTEST_NAME.fullmatch(c.name)]  # libtest's verdicts
        kept.extend(own if declared is not None and len(block) > declared == len(own) else block)
        block.clear()

    for line in text.splitlines():
        running = _CARGO_RUNNING.fullmatch(line)
        if running or _CARGO_SUMMARY.match(line):
            close()
            declared = int(running.group(1)) if running else None
            continue
        verdict = _CARGO_VERDICT.fullmatch(line.strip())
        if verdict and (waiting or declared is not None):
            case(waiting.pop() if waiting else UNANNOUNCED, verdict.group(1))
            continue
        while (m := _CARGO_TEST.match(line)) is not None:
            verdict = _CARGO_VERDICT.fullmatch(m.group(2))
            if verdict:
                case(m.group(1), verdict.group(1))
                break
            waiting.append(m.group(1))  # announced; what follows on the line is the test's own output
            line = m.group(2)
    close()
    return tally("cargo test", kept, summary)


_AUTOMAKE = re.compile(r"^(PASS|FAIL|XFAIL|XPASS|SKIP|ERROR): (.+?)\s*$", re.MULTILINE)
_AUTOMAKE_OUTCOME: dict[str, Outcome] = {"PASS": "passed", "XFAIL": "passed", "FAIL": "failed", "XPASS": "failed",
                                          "SKIP": "skipped", "ERROR": "error"}


def automake(text: str) -> TestReport:
    """The lines automake's test harness prints per test (``make check``)."""
    return tally("make check", [TestCaseResult(name=m.group(2), outcome=_AUTOMAKE_OUTCOME[m.group(1)])
                                for m in _AUTOMAKE.finditer(text)])


# A description is optional (``ok 5``), as is the dash before it; a directive follows ``#``.
_TAP = re.compile(r"^[ \t]*(not ok|ok)[ \t]+\d+(?:[ \t]+-)?(?:[ \t]+(.*?))?(?:[ \t]*#[ \t]*(SKIP|TODO)\b.*)?[ \t]*$",
                  re.MULTILINE | re.IGNORECASE)


def tap(text: str, runner: str) -> TestReport:
    cases = []
    for m in _TAP.finditer(text):
        outcome = "skipped" if m.group(3) else ("passed" if m.group(1) == "ok" else "failed")
        cases.append(TestCaseResult(name=(m.group(2) or "").strip() or "unnamed", outcome=outcome))
    return tally(runner, cases)


_TAP_POINT = re.compile(r"^( *)(not ok|ok)\b[ \t]*\d*(?:[ \t]+-)?(?:[ \t]+(.*?))?(?:[ \t]*#[ \t]*(SKIP|TODO)\b.*)?"
                        r"[ \t]*$", re.IGNORECASE)
_TAP_PLAN = re.compile(r"^( *)1\.\.(\d+)\b")
_TAP_SUBTEST = re.compile(r"^( *)# Subtest: (.*?)\s*$")


def tap_with_summary(text: str, runner: str) -> TestReport:
    """A TAP stream a runner writes with its own count at the end (ava's ``--tap``, QUnit's ``--reporter tap``:
    ``# pass N`` / ``# fail N``): every point is a case, checked against that count."""
    report = tap(text, runner)
    summary = _tap_counts(text)
    return report.model_copy(update={"summary_passed": summary[0] if summary else None,
                                     "summary_failed": summary[1] if summary else None})


def _tap_counts(text: str) -> tuple[int, int] | None:
    passed, failed = _count(r"^# pass\s+(\d+)\s*$", text), _count(r"^# fail\s+(\d+)\s*$", text)
    return None if passed is None and failed is None else (passed or 0, failed or 0)


def tap_subtests(text: str, runner: str) -> TestReport:
    """node-tap's TAP (``tap -R tap``): a test is a subtest (its point follows a ``# Subtest: name`` block at the
    same indent) with no subtests of its own, or a skipped one; the assertions inside it are no tests. node-tap
    prints no total of its tests, so the stream is checked against itself: at every level the points must be as
    many as its plan (``1..N``) says. A stream where they are not (points printed by the code under test into the
    test's output), or a level without its plan (a run cut short), is not itemised."""
    lines = text.splitlines()
    cases: list[TestCaseResult] = []
    # Per open block (by indent): [points seen, plan, whether a subtest point was seen inside].
    blocks: dict[int, list[int]] = {}
    header: dict[int, str] = {}
    for line in lines:
        sub = _TAP_SUBTEST.match(line)
        if sub:
            header[len(sub.group(1))] = sub.group(2)
            continue
        plan = _TAP_PLAN.match(line)
        if plan:
            block = blocks.setdefault(len(plan.group(1)), [0, -1, 0])
            block[1] = int(plan.group(2))
            continue
        point = _TAP_POINT.match(line)
        if not point:
            continue
        indent, name = len(point.group(1)), (point.group(3) or "").strip()
        name = re.sub(r"\s*# time=[\d.]+m?s$", "", name)
        block = blocks.setdefault(indent, [0, -1, 0])
        block[0] += 1
        # The block of this point's children (indent + 4) closes here: it must hold as many points as its plan.
        children = blocks.pop(indent + 4, None)
        if children is not None and children[0] != children[1]:
            return TestReport(runner=runner, itemised=False)
        is_subtest = header.pop(indent, None) is not None
        has_subtests = bool(children and children[2])
        if is_subtest or point.group(4):
            block[2] = 1
        if (is_subtest or point.group(4)) and not has_subtests:
            outcome = "skipped" if point.group(4) else ("passed" if point.group(2).lower() == "ok" else "failed")
            cases.append(TestCaseResult(name=name or "unnamed", outcome=outcome))
    if any(b[0] != b[1] for b in blocks.values()):
        return TestReport(runner=runner, itemised=False)
    return tally(runner, cases)


def jest_json(text: str, runner: str) -> TestReport:
    """jest's ``--json`` report (vitest's ``json`` reporter writes the same shape): one case per assertion result;
    ``numPassedTests``/``numFailedTests`` are the runner's summary."""
    doc = _json(text, f"{runner} JSON")
    outcome: dict[str, Outcome] = {"passed": "passed", "failed": "failed", "pending": "skipped",
                                   "skipped": "skipped", "todo": "skipped", "disabled": "skipped"}
    cases = []
    try:
        for suite in doc["testResults"]:
            for result in suite["assertionResults"]:
                name = str(result.get("fullName") or " ".join([*result.get("ancestorTitles", []),
                                                                result.get("title", "")]).strip() or "unnamed")
                cases.append(TestCaseResult(name=name, outcome=outcome.get(result["status"], "error"),
                                            duration_s=(result.get("duration") or 0) / 1000,
                                            message="\n".join(result.get("failureMessages") or [])[:2000]))
        summary = (int(doc["numPassedTests"]), int(doc["numFailedTests"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ReportError(f"{runner} JSON lacks {e}") from None
    return tally(runner, cases, summary)


# Per-test lines of test binaries and make-driven suites, one pattern per convention: (regex, name group, outcome
# group); the convention that reads the most cases wins.
_OUTCOME: dict[str, Outcome] = {"pass": "passed", "passed": "passed", "ok": "passed", "fail": "failed",
                                 "failed": "failed", "skip": "skipped", "skipped": "skipped", "ignore": "skipped",
                                 "error": "error"}
_PER_TEST = (
    # GoogleTest: "[       OK ] Suite.Name (0 ms)", "[  FAILED  ] Suite.Name (1 ms)" (the final list has no time).
    (re.compile(r"^\[\s*(OK|FAILED|SKIPPED)\s*\] (\S+) \(\d+ ms\)\s*$", re.MULTILINE), 2, 1),
    # Unity: "test/test_calc.c:12:test_adds:PASS", ":FAIL: message", ":IGNORE".
    (re.compile(r"^[^\s:]+:\d+:(\w+):(PASS|FAIL|IGNORE)\b", re.MULTILINE), 1, 2),
    # "PASS: name", "[PASS] name", "FAILED name" (automake's and many hand-written harnesses').
    (re.compile(r"^[ \t]*\[?(PASS|PASSED|FAIL|FAILED|SKIP|SKIPPED|ERROR)\]?:?[ \t]+(?!\d+ tests?\b)(\S.*?)[ \t]*$",
                re.MULTILINE), 2, 1),
    # "name ... ok" (unittest, cargo-like), "name ... FAILED".
    (re.compile(r"^[ \t]*(\S.*?)[ \t]*\.{2,}[ \t]*(ok|PASS|PASSED|FAIL|FAILED|SKIP|SKIPPED|skipped|ERROR)[ \t]*$",
                re.MULTILINE), 1, 2),
    # "name: PASSED" (upper case only: "large_inflate(): OK" among a program's own output is no verdict).
    (re.compile(r"^[ \t]*(\S.*?):[ \t]*(PASS|PASSED|FAIL|FAILED|SKIP|SKIPPED|ERROR)[ \t]*$", re.MULTILINE), 1, 2),
    # A banner per make target: "*** zlib shared test OK ***", "*** zlib test FAILED ***" (real: zlib 1.2.13, one
    # per target of "make test": teststatic, testshared, test64; the lines are its only verdicts).
    (re.compile(r"^[ \t]*\*{3}[ \t]*(\S.*?)[ \t]+(OK|PASS|PASSED|FAIL|FAILED)[ \t]*\*{3}[ \t]*$",
                re.MULTILINE), 1, 2),
)


_SEVERITY: dict[Outcome, int] = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def per_test_lines(text: str, runner: str) -> TestReport:
    """Per-test results from a suite's printed lines: TAP, automake's harness (XFAIL/XPASS included), or the
    per-test convention (above) with the most cases, earlier ones winning ties — among those that agree with the
    runner's summary line when one does (automake's harness counts a test program once, while the GoogleTest cases
    it runs print lines of their own: real, audiofile 0.3.6). A name seen twice keeps its worst outcome: the judged
    code shares the runner's stdout, and a "PASS: name" it prints before or after the runner's "FAIL: name" must not
    undo the failure. The runner's summary line, if any, is attached."""
    candidates = [tap(text, runner).cases, automake(text).cases]
    for pattern, name_group, outcome_group in _PER_TEST:
        found: dict[str, TestCaseResult] = {}
        for m in pattern.finditer(text):
            name, outcome = m.group(name_group), _OUTCOME[m.group(outcome_group).lower()]
            if name not in found or _SEVERITY[outcome] > _SEVERITY[found[name].outcome]:
                found[name] = TestCaseResult(name=name, outcome=outcome)
        candidates.append(list(found.values()))
    summary = runner_summary(text)
    agreeing = [cases for cases in candidates if cases and summary is not None
                and unusable_reason(tally(runner, cases, summary)) is None]
    return tally(runner, max(agreeing or candidates, key=len), summary)


def _count(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text, re.MULTILINE | re.IGNORECASE)
    return sum(int(x) for x in found) if found else None


# Summary lines, one family per runner convention: (passed pattern, failed pattern), each with one count group;
# matches of a family are summed (one summary per test binary or file). The first family that matches is the
# runner's.
_SUMMARIES = (
    (r"^\s*(\d+) passing\b", r"^\s*(\d+) failing\b"),  # mocha's spec/dot reporters
    (r"^Tests:.*?\b(\d+) passed\b.*\btotal\s*$", r"^Tests:.*?\b(\d+) failed\b.*\btotal\s*$"),  # jest
    (r"^\s*Tests\s+.*?\b(\d+) passed\b.*\(\d+\)\s*$", r"^\s*Tests\s+.*?\b(\d+) failed\b.*\(\d+\)\s*$"),  # vitest
    (r"^(?:#|\u2139)\s*pass\s+(\d+)\s*$", r"^(?:#|\u2139)\s*fail\s+(\d+)\s*$"),  # TAP, node --test (info sign)
    (r"^\[\s*PASSED\s*\]\s+(\d+) tests?\b", r"^\[\s*FAILED\s*\]\s+(\d+) tests?,"),  # GoogleTest
    (r"^# (?:PASS|XFAIL):\s+(\d+)\s*$", r"^# (?:FAIL|XPASS|ERROR):\s+(\d+)\s*$"),  # automake
    (r"^\s*Tests? passed:\s*(\d+)\b", r"^\s*Tests? failed:\s*(\d+)\b"),  # "Tests passed: 349"
    (r"^\s*(\d+) tests? passed\b", r"^\s*(\d+) tests? failed\b"),  # ava, many harnesses
)
_UNITY = re.compile(r"^(\d+) Tests (\d+) Failures (\d+) Ignored\s*$", re.MULTILINE)
# automake's serial harness (no parallel-tests): one banner per directory, "All 12 tests passed", "1 test
# passed", "2 of 12 tests failed" (real: libgpg-error 1.46, whose "1 test passed" alone counted 1 of 13).
_SERIAL_ALL = re.compile(r"^=*\s*All (\d+) tests? passed\b", re.MULTILINE)
_SERIAL = re.compile(r"^=*\s*(?:All (\d+) tests? passed|(\d+) tests? passed|(\d+) of (\d+) tests? failed)\b",
                     re.MULTILINE)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def runner_summary(text: str) -> tuple[int, int] | None:
    """(passed, failed) from the runner's own summary line(s), or None when it printed none kiln knows. Colour
    codes are no part of a line (mocha 1.x colours "17 passing" even into a pipe)."""
    text = _ANSI.sub("", text)
    unity = _UNITY.findall(text)
    if unity:
        return (sum(max(0, int(t) - int(f) - int(i)) for t, f, i in unity), sum(int(f) for _t, f, _i in unity))
    if _SERIAL_ALL.search(text) or re.search(r"^=*\s*\d+ of \d+ tests? failed\b", text, re.MULTILINE):
        ok = not_ok = 0
        for every, some, bad, out_of in _SERIAL.findall(text):
            ok += int(every or some or 0) + (int(out_of) - int(bad) if bad else 0)
            not_ok += int(bad or 0)
        return ok, not_ok
    for passed, failed in _SUMMARIES:
        p, f = _count(passed, text), _count(failed, text)
        if p is not None or f is not None:
            return p or 0, f or 0
    return None


# Summaries of runners whose per-test results come from a file kiln's reporter writes (uvu, jasmine, meson,
# Maven): what the runner itself prints at the end, read strictly (one family per runner, never another's).
_UVU_TOTALS = re.compile(r"^\s*Total:\s+(\d+)\s*\n\s*Passed:\s+(\d+)\s*$", re.MULTILINE)
_JASMINE = re.compile(r"^(\d+) specs?, (\d+) failures?(?:, (\d+) pending specs?)?\s*$", re.MULTILINE)
_MESON = re.compile(r"^(Ok|Expected Fail|Fail|Unexpected Pass|Skipped|Timeout):\s+(\d+)\s*$", re.MULTILINE)
# Maven's per-module totals after "Results:" (a per-class line goes on: ", Time elapsed: … in <class>").
_MAVEN = re.compile(r"^(?:\[\w+\] )?Tests run: (\d+), Failures: (\d+), Errors: (\d+), Skipped: (\d+)"
                    r"(?:, Flakes: \d+)?\s*$", re.MULTILINE)


def printed_summary(runner: str, text: str) -> tuple[int, int] | None:
    """(passed, failed) by what ``runner`` (uvu, jasmine, meson, maven) prints at the end, summed over modules
    where it prints one per module; None when it printed none."""
    text = _ANSI.sub("", text)
    if runner == "uvu":
        found = [(int(p), int(t) - int(p)) for t, p in _UVU_TOTALS.findall(text)]
    elif runner == "jasmine":
        found = [(int(s) - int(f) - int(p or 0), int(f)) for s, f, p in _JASMINE.findall(text)]
    elif runner == "maven":
        found = [(int(r) - int(f) - int(e) - int(s), int(f) + int(e)) for r, f, e, s in _MAVEN.findall(text)]
    elif runner == "meson":
        counts = {k: 0 for k in ("Ok", "Expected Fail", "Fail", "Unexpected Pass", "Timeout")}
        matched = _MESON.findall(text)
        for kind, n in matched:
            counts[kind] = counts.get(kind, 0) + int(n)
        found = [(counts["Ok"] + counts["Expected Fail"], counts["Fail"] + counts["Unexpected Pass"]
                  + counts["Timeout"])] if matched else []
    else:
        raise ValueError(f"no printed summary known for {runner}")
    return (sum(p for p, _f in found), sum(f for _p, f in found)) if found else None


_MESON_OUTCOME: dict[str, Outcome] = {"OK": "passed", "EXPECTEDFAIL": "passed", "SKIP": "skipped", "FAIL": "failed",
                                      "UNEXPECTEDPASS": "failed", "TIMEOUT": "failed", "ERROR": "error"}


def meson_testlog(text: str, printed: str = "") -> TestReport:
    """meson's ``meson-logs/testlog.json`` (one JSON object per test, written by ``meson test``), checked against
    the counts ``meson test`` prints (``Ok: 2``, ``Fail: 0``, …)."""
    cases = []
    for line in text.splitlines():
        if not line.strip():
            continue
        doc = _json(line, "meson testlog.json")
        try:
            name, result = str(doc["name"]), str(doc["result"])
            duration = float(doc.get("duration") or 0)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ReportError(f"meson testlog.json lacks {e}") from None
        if result not in _MESON_OUTCOME:
            raise ReportError(f"meson testlog.json: unknown result {result[:40]!r}")
        cases.append(TestCaseResult(name=name, outcome=_MESON_OUTCOME[result], duration_s=duration,
                                    message=str(doc.get("stdo") or "")[-2000:] if result != "OK" else ""))
    return tally("meson test", cases, printed_summary("meson", printed))


def junit_files(texts: list[str], runner: str, summary: tuple[int, int] | None, from_files: bool = False) -> TestReport:
    """JUnit XML written one file per test class (Maven Surefire's ``TEST-*.xml``, Gradle's), as one report.
    ``summary``: the runner's own count; ``from_files``: for Gradle, which prints none when every test passes, the
    counts Gradle wrote on each file's root suite instead."""
    cases: list[TestCaseResult] = []
    counted: list[tuple[int, int]] = []
    for text in texts:
        report = junit(text, runner)
        cases += report.cases
        try:
            own = _suite_summary(ET.fromstring(text))
        except ET.ParseError:
            own = None
        if own is not None:
            counted.append(own)
    if from_files and counted:
        summary = (sum(p for p, _f in counted), sum(f for _p, f in counted))
    return tally(runner, cases, summary)


def jacoco_xml(reports: list[tuple[str, str]]) -> CoverageReport:
    """JaCoCo's XML reports, each with the source directory of its module (``src/main/java`` under it): a line is
    executable when it has instructions (``mi`` + ``ci`` > 0), covered when one of them ran (``ci`` > 0)."""
    files: dict[str, tuple[set[int], set[int]]] = {}
    for source_root, text in reports:
        try:
            root = ET.fromstring(text)
        except ET.ParseError as e:
            raise ReportError(f"JaCoCo XML does not parse: {e}") from None
        for package in root.iter("package"):
            for source in package.iter("sourcefile"):
                path = "/".join(x for x in (source_root.strip("/"), package.get("name", ""), source.get("name", ""))
                                if x)
                exe, cov = files.setdefault(_relative(path, ("/work",)), (set(), set()))
                for line in source.iter("line"):
                    try:
                        number, missed, covered = (int(line.get(a) or 0) for a in ("nr", "mi", "ci"))
                    except ValueError:
                        raise ReportError(f"JaCoCo XML: bad line {line.attrib}") from None
                    if missed + covered:
                        exe.add(number)
                        if covered:
                            cov.add(number)
    return coverage_report("jacoco", files)


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ReportError(f"{what} does not parse: {e}") from None


def coverage_py(text: str, roots: Iterable[str] = ("/work",)) -> CoverageReport:
    doc = _json(text, "coverage.py JSON")
    files: dict[str, tuple[set[int], set[int]]] = {}
    try:
        for path, data in doc["files"].items():
            executed, missing = set(data["executed_lines"]), set(data["missing_lines"])
            files[_relative(path, roots)] = (executed | missing, executed)
    except (KeyError, TypeError, AttributeError) as e:
        raise ReportError(f"coverage.py JSON lacks {e}") from None
    return coverage_report("coverage.py", files)


_PROFILE = re.compile(r"^(.+):(\d+)\.\d+,(\d+)\.\d+ (\d+) (\d+)$")


def go_cover_profile(text: str, module: str = "") -> CoverageReport:
    """Lines of every block with statements are executable; covered when the block ran."""
    files: dict[str, tuple[set[int], set[int]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("mode:"):
            continue
        m = _PROFILE.match(line)
        if not m:
            raise ReportError(f"not a cover profile line: {line[:200]!r}")
        path, start, end, stmts, count = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))
        if module and path.startswith(module + "/"):
            path = path[len(module) + 1:]
        exe, cov = files.setdefault(path, (set(), set()))
        if stmts:
            span = set(range(start, end + 1))
            exe |= span
            if count:
                cov |= span
    return coverage_report("go cover", files)


def gcov_json(text: str, roots: Iterable[str] = ("/work",)) -> CoverageReport:
    files: dict[str, tuple[set[int], set[int]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        doc = _json(line, "gcov JSON")
        try:
            # A path relative to where the compiler ran (meson compiles ../src/x.c from its build directory).
            cwd = str(doc.get("current_working_directory") or "")
            for entry in doc["files"]:
                name = str(entry["file"])
                path = _relative(os.path.normpath(os.path.join(cwd, name)) if cwd and not name.startswith("/") else
                                 name, roots)
                if path.startswith("/usr/") or "CMakeFiles" in path:
                    continue
                exe, cov = files.setdefault(path, (set(), set()))
                for ln in entry["lines"]:
                    exe.add(int(ln["line_number"]))
                    if int(ln["count"]) > 0:
                        cov.add(int(ln["line_number"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ReportError(f"gcov JSON lacks {e}") from None
    return coverage_report("gcov", files)


def lcov(text: str, tool: str, roots: Iterable[str] = ("/work",)) -> CoverageReport:
    """An lcov tracefile: ``SF:`` opens a file, ``DA:line,count`` marks an executable line."""
    files: dict[str, tuple[set[int], set[int]]] = {}
    current: tuple[set[int], set[int]] | None = None
    for line in text.splitlines():
        if line.startswith("SF:"):
            current = files.setdefault(_relative(line[3:].strip(), roots), (set(), set()))
        elif line.startswith("DA:") and current is not None:
            try:
                number, count = line[3:].split(",")[:2]
                current[0].add(int(number))
                if int(float(count)) > 0:
                    current[1].add(int(number))
            except ValueError:
                raise ReportError(f"bad lcov line {line[:100]!r}") from None
        elif line == "end_of_record":
            current = None
    return coverage_report(tool, files)


def istanbul(text: str, roots: Iterable[str] = ("/work",)) -> CoverageReport:
    """c8/nyc ``coverage-final.json``: a line is executable when a statement starts on it, covered when one ran."""
    doc = _json(text, "istanbul JSON")
    files: dict[str, tuple[set[int], set[int]]] = {}
    try:
        for path, data in doc.items():
            exe, cov = files.setdefault(_relative(path, roots), (set(), set()))
            for sid, loc in data["statementMap"].items():
                line = int(loc["start"]["line"])
                exe.add(line)
                if int(data["s"].get(sid, 0)) > 0:
                    cov.add(line)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ReportError(f"istanbul JSON lacks {e}") from None
    return coverage_report("c8", files)


def unusable_reason(report: TestReport) -> tuple[FailureClass, str] | None:
    """Why a report cannot be trusted for per-test rewards — (failure class, reason) — or None: per-test results
    with >= 1 passing test that agree with the runner's own summary when it printed one."""
    if not report.itemised:
        said = (f"; the runner's summary says {report.summary_passed} passed, {report.summary_failed} failed"
                if report.summary_passed is not None else "; the runner printed no summary kiln knows")
        return "tests_not_itemised", f"the runner's per-test results could not be read{said}"
    collection = [c for c in report.cases if c.outcome == "error" and "collection" in c.message.lower()]
    if collection:
        return "tests_did_not_run", f"{len(collection)} test modules failed to collect (e.g. {collection[0].name})"
    if report.passed + report.failed + report.errors == 0:
        return "tests_did_not_run", "no test was executed"
    if report.passed == 0:
        return "tests_did_not_run", f"no test passed ({report.failed + report.errors} failed)"
    # Some runners count a skipped test among the passes (tape's "ok … # SKIP", vitest 1.6's JSON); kiln reports
    # it skipped.
    if report.summary_passed is not None and (report.summary_failed != report.failed + report.errors or
                                              report.summary_passed not in (report.passed,
                                                                            report.passed + report.skipped)):
        return "tests_not_itemised", (f"the per-test results ({report.passed} passed, {report.failed + report.errors} "
                                      f"failed) disagree with the runner's summary ({report.summary_passed} passed, "
                                      f"{report.summary_failed} failed)")
    return None


# Report files a test command leaves in the reports directory, most trusted first: what a reporter kiln chose
# wrote, then the output kiln tee'd (parsed line by line).
_STRUCTURED: tuple[tuple[str, Callable[[str, str], TestReport]], ...] = (
    ("junit.xml", lambda t, _m: junit(t, "pytest")), ("ctest.xml", lambda t, _m: junit(t, "ctest")),
    ("go-test.json", lambda t, _m: go_test_json(t)), ("cargo-test.txt", lambda t, _m: cargo_test(t)),
    ("mocha.xml", lambda t, _m: junit(t, "mocha", summary=True)), ("jest.json", lambda t, _m: jest_json(t, "jest")),
    ("vitest.json", lambda t, _m: jest_json(t, "vitest")), ("node-tap.txt", lambda t, _m: tap(t, "node --test")),
)
_PRINTED = ("make-check.txt", "test-output.txt")


def _with(report: TestReport, summary: tuple[int, int] | None) -> TestReport:
    return report.model_copy(update={"summary_passed": summary[0] if summary else None,
                                     "summary_failed": summary[1] if summary else None})


EXPECTED_REPORTS = "kiln-expected"


def _kiln_reporter(text: dict[str, str], printed: str) -> TestReport | None:
    """The report of a runner whose results a reporter of kiln's choosing left (Maven Surefire's and Gradle's JUnit
    files, meson's testlog, the TAP of ava, QUnit and node-tap, kiln's own uvu and jasmine reporters), checked
    against the runner's own count; None when none is there. It is the run's only word: never read from the
    printed lines instead, which the code under test shares."""
    surefire = [t for n, t in sorted(text.items()) if n.startswith("surefire/") and n.endswith(".xml")]
    gradle = [t for n, t in sorted(text.items()) if n.startswith("gradle/") and n.endswith(".xml")]
    report: TestReport | None = None
    # The test command makes the directory's marker (``EXPECTED_REPORTS``) before the runner starts: a run that
    # left no report file there is a run without results, never one read from its printed lines.
    if surefire or f"surefire/{EXPECTED_REPORTS}" in text:
        report = junit_files(surefire, "maven", printed_summary("maven", printed))
    elif gradle or f"gradle/{EXPECTED_REPORTS}" in text:
        report = junit_files(gradle, "gradle", None, from_files=True)
    elif "meson-testlog.json" in text:
        report = meson_testlog(text["meson-testlog.json"], printed)
    elif "tap.tap" in text:
        return tap_subtests(text["tap.tap"], "tap")  # checked against its plans instead
    for runner in ("uvu", "jasmine"):
        if report is None and f"{runner}.tap" in text:
            report = _with(tap(text[f"{runner}.tap"], runner), printed_summary(runner, printed))
    for runner in ("ava", "qunit"):
        if report is None and f"{runner}.tap" in text:
            report = tap_with_summary(text[f"{runner}.tap"], runner)
    if report is not None and report.summary_passed is None:
        # Without the runner's count nothing says the results are all of them (a process that exits 0 halfway,
        # its report cut short, would look like a clean pass).
        return TestReport(runner=report.runner, itemised=False)
    return report


def parse_results(system: str, exit_code: int | None, files: dict[str, bytes], module: str = "") -> TestReport | None:
    """The test report (with coverage) from the files a test run left in the reports directory; None when the
    suite did not run (a missing command; or a failing exit with neither per-test results nor a summary). A run
    without per-test results is a report with ``itemised=False`` (see ``unusable_reason``)."""
    text = {name: data.decode(errors="replace") for name, data in files.items()}
    report: TestReport | None = None
    for name, parse in _STRUCTURED:
        if name in text:
            report = parse(text[name], module)
            if report.cases:
                break
    printed = next((text[n] for n in _PRINTED if n in text), "")
    own = _kiln_reporter(text, printed) if report is None or not report.cases else None
    if own is not None and not own.cases:
        if exit_code in (None, 126, 127) or (own.summary_passed is None and exit_code != 0):
            return None
        own = TestReport(runner=own.runner, itemised=False, summary_passed=own.summary_passed,
                         summary_failed=own.summary_failed)
    if own is not None:
        report = own
    xunit = re.search(r"<testsuite\b.*</testsuite>", printed, re.DOTALL)
    if (report is None or not report.cases) and xunit and own is None:
        # mocha before 2.2 has no output option for its xunit reporter: the XML is among the printed lines (real:
        # etag's mocha 1.21).
        with contextlib.suppress(ReportError):
            report = junit(xunit.group(0), "mocha", summary=True)
    if (report is None or not report.cases) and printed and own is None:
        report = per_test_lines(printed, "make check" if system in ("make", "autotools") else f"{system} test")
    if (report is None or not report.cases) and own is None:
        summary = runner_summary(printed) if printed else None
        if exit_code in (None, 126, 127) or (summary is None and exit_code != 0):
            return None
        report = TestReport(runner=report.runner if report else system, itemised=False,
                            summary_passed=summary[0] if summary else None,
                            summary_failed=summary[1] if summary else None)
    coverage = None
    if "coverage-py.json" in text:
        coverage = coverage_py(text["coverage-py.json"])
    elif "cover.out" in text:
        coverage = go_cover_profile(text["cover.out"], module)
    elif "gcov.jsonl" in text:
        coverage = gcov_json(text["gcov.jsonl"], ("/work/build", "/work"))
    elif "coverage-final.json" in text:
        coverage = istanbul(text["coverage-final.json"])
    elif "lcov.info" in text:
        coverage = lcov(text["lcov.info"], "llvm-cov")
    elif any(n.startswith("jacoco/") for n in text):
        coverage = jacoco_xml([(text.get(n[:-4] + ".dir", "").strip(), t) for n, t in sorted(text.items())
                               if n.startswith("jacoco/") and n.endswith(".xml")])
    assert report is not None
    return report.model_copy(update={"coverage": coverage})


_FINDING = re.compile(r"^(?:\./)?([^:\s][^:]*):(\d+):(?:(\d+):)?\s*(.+)$", re.MULTILINE)


def lint_findings(output: str) -> list[LintFinding]:
    """Findings from ruff's JSON, or from the ``path:line[:col]: message`` lines most linters print."""
    stripped = output.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
            return [LintFinding(path=_relative(str(i["filename"]), ("/work",)), line=i["location"]["row"],
                                column=i["location"]["column"], code=i.get("code"), message=str(i["message"]))
                    for i in items]
        except (ValueError, KeyError, TypeError) as e:
            raise ReportError(f"ruff JSON does not parse: {e}") from None
    return [LintFinding(path=m.group(1), line=int(m.group(2)), column=int(m.group(3)) if m.group(3) else None,
                        message=m.group(4).strip()) for m in _FINDING.finditer(output)]
