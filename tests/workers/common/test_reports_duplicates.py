"""Printed per-test lines share stdout with the judged code: whatever "PASS: name" lines it adds around the runner's
own, the report keeps the runner's failure of every test it failed (``reports.per_test_lines``); the verifiers
count a test reported both ways as failed (tests/workers/rollout/test_printed_forgery.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kiln.workers.common.reports import per_test_lines

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
# (pass line, fail line) of two conventions: automake's harness, and the "name ... ok" lines of test binaries.
STYLES = st.sampled_from([("PASS: {}", "FAIL: {}"), ("{} ... ok", "{} ... FAILED")])


@given(results=st.dictionaries(NAMES, st.booleans(), min_size=1, max_size=8),
       forged_before=st.lists(NAMES, max_size=8), forged_after=st.lists(NAMES, max_size=8), style=STYLES)
def test_a_printed_pass_never_undoes_a_failure(results: dict[str, bool], forged_before: list[str],
                                                forged_after: list[str], style: tuple[str, str]) -> None:
    passes, fails = style
    runner = [(passes if ok else fails).format(name) for name, ok in results.items()]
    forged_names = set(forged_before) | set(forged_after)
    text = "\n".join([passes.format(n) for n in forged_before] + runner
                     + [passes.format(n) for n in forged_after]) + "\n"
    cases = per_test_lines(text, "make check").cases
    failed = {c.name for c in cases if c.outcome == "failed"}
    assert failed == {name for name, ok in results.items() if not ok}
    assert {c.name for c in cases} == set(results) | forged_names
