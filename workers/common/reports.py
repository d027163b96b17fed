"""Parsers from each ecosystem's test and coverage output to kiln's unified ``TestReport`` / ``CoverageReport``.

Test results: JUnit XML (pytest, CTest), ``go test -json``, ``cargo test`` text, automake's ``make check`` lines,
TAP (``node --test`` and others). Coverage: coverage.py JSON, Go cover profiles, gcov JSON (GCC), istanbul JSON
(c8/nyc), lcov (llvm-cov, for Rust). Every parser raises ``ReportError`` on malformed input and nothing else;
paths are made relative to the project root.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import Any

from kiln.schemas.exec import LintFinding
from kiln.schemas.reports import CoverageReport, FileCoverage, TestCaseResult, TestReport
from kiln.streams.errors import KilnError


class ReportError(KilnError):
    """A test or coverage report does not parse."""


def _relative(path: str, roots: Iterable[str]) -> str:
    for root in roots:
        root = root.rstrip("/") + "/"
        if path.startswith(root):
            return path[len(root):]
    return path[2:] if path.startswith("./") else path


def tally(runner: str, cases: list[TestCaseResult]) -> TestReport:
    count = {o: sum(1 for c in cases if c.outcome == o) for o in ("passed", "failed", "skipped", "error")}
    return TestReport(runner=runner, passed=count["passed"], failed=count["failed"], skipped=count["skipped"],
                      errors=count["error"], cases=cases)


def coverage_report(tool: str, files: dict[str, tuple[set[int], set[int]]]) -> CoverageReport:
    entries = [FileCoverage(path=path, executable_lines=sorted(exe), covered_lines=sorted(cov & exe))
               for path, (exe, cov) in sorted(files.items()) if exe]
    return CoverageReport(tool=tool, files=entries, lines_total=sum(len(f.executable_lines) for f in entries),
                          lines_covered=sum(len(f.covered_lines) for f in entries))


def junit(xml_text: str, runner: str) -> TestReport:
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
    return tally(runner, cases)


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


_CARGO = re.compile(r"^test (.+?) \.\.\. (ok|FAILED|ignored)(?:, .*)?$", re.MULTILINE)
_CARGO_SUMMARY = re.compile(r"^test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", re.MULTILINE)


def cargo_test(text: str) -> TestReport:
    """One case per ``test NAME ... ok`` line (doc tests' names have spaces); the counts are checked against the
    ``test result:`` summary of every test binary, which wins when they disagree (``-q`` prints no names)."""
    outcome = {"ok": "passed", "FAILED": "failed", "ignored": "skipped"}
    report = tally("cargo test", [TestCaseResult(name=m.group(1), outcome=outcome[m.group(2)])
                                  for m in _CARGO.finditer(text)])
    summaries = [tuple(int(x) for x in m.groups()) for m in _CARGO_SUMMARY.finditer(text)]
    if summaries:
        passed, failed, ignored = (sum(s[i] for s in summaries) for i in range(3))
        if (passed, failed, ignored) != (report.passed, report.failed, report.skipped):
            report = report.model_copy(update={"passed": passed, "failed": failed, "skipped": ignored})
    return report


_AUTOMAKE = re.compile(r"^(PASS|FAIL|XFAIL|XPASS|SKIP|ERROR): (.+?)\s*$", re.MULTILINE)


def automake(text: str) -> TestReport:
    """The lines automake's test harness prints per test (``make check``)."""
    outcome = {"PASS": "passed", "XFAIL": "passed", "FAIL": "failed", "XPASS": "failed", "SKIP": "skipped",
               "ERROR": "error"}
    return tally("make check", [TestCaseResult(name=m.group(2), outcome=outcome[m.group(1)])
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
            for entry in doc["files"]:
                path = _relative(entry["file"], roots)
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


def not_run_reason(report: TestReport) -> str | None:
    """Why a report shows the suite did not really run (collection errors, nothing executed), or None."""
    collection = [c for c in report.cases if c.outcome == "error" and "collection" in c.message.lower()]
    if collection:
        return f"{len(collection)} test modules failed to collect (e.g. {collection[0].name})"
    if report.passed + report.failed == 0:
        return "no test was executed"
    return None


def parse_results(system: str, exit_code: int | None, files: dict[str, bytes], module: str = "") -> TestReport | None:
    """The test report (with coverage) from the files a test run left in the reports directory; None when the
    suite did not run (no per-test results and a failing exit, or a missing command)."""
    text = {name: data.decode(errors="replace") for name, data in files.items()}
    report: TestReport | None = None
    if "junit.xml" in text:
        report = junit(text["junit.xml"], "pytest")
    elif "ctest.xml" in text:
        report = junit(text["ctest.xml"], "ctest")
    elif "go-test.json" in text:
        report = go_test_json(text["go-test.json"])
    elif "cargo-test.txt" in text:
        report = cargo_test(text["cargo-test.txt"])
    elif "make-check.txt" in text:
        report = automake(text["make-check.txt"])
    elif "test-output.txt" in text:
        report = tap(text["test-output.txt"], f"{system} test")
    if report is None or not report.cases:
        if exit_code is None or exit_code in (126, 127) or exit_code != 0:
            return None
        # The runner gives no per-test results and succeeded: the suite is one case.
        report = tally(system, [TestCaseResult(name=f"{system} test suite", outcome="passed")])
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
