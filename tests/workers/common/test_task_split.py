"""FAIL_TO_PASS / PASS_TO_PASS from per-test results of runs before and after a gold patch: the split, flaky
tests dropped, and the runs that make a task invalid."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kiln.schemas import reports as schema
from kiln.workers.common.reports import tally
from kiln.workers.common.swe import split


def run(**outcomes: str) -> schema.TestReport:
    return tally("pytest", [schema.TestCaseResult(name=n, outcome=o) for n, o in outcomes.items()])


def test_tests_failing_before_and_passing_after_are_fail_to_pass() -> None:
    before = [run(old="passed", new="failed", gone="passed"), run(old="passed", new="error", gone="passed")]
    after = [run(old="passed", new="passed", added="passed", gone="failed")] * 2
    result = split(list(before), list(after))
    # "added" is absent before (its module did not import): it did not pass there.
    assert (result.valid, result.failure, result.fail_to_pass, result.pass_to_pass, result.flaky) == (
        True, None, ["added", "new"], ["old"], [])


def test_flaky_tests_are_in_neither_list_and_an_empty_fail_to_pass_is_invalid() -> None:
    before = [run(old="passed", coin="passed"), run(old="passed", coin="failed")]
    after = [run(old="passed", coin="passed"), run(old="passed", coin="passed")]
    result = split(list(before), list(after))
    assert (result.valid, result.fail_to_pass, result.pass_to_pass, result.flaky) == (False, [], ["old"], ["coin"])
    # Only the dropped flaky test would have been FAIL_TO_PASS: that is the class, not a plain empty split.
    assert result.failure == "fail_to_pass_flaky"
    assert result.reason == ("no test fails before the gold patch and passes after it (FAIL_TO_PASS is empty); "
                             "flaky, dropped: coin")
    # A flaky test that never passes after the fix was never a candidate: the split is simply empty.
    unrelated = split([run(old="passed", coin="passed"), run(old="passed", coin="failed")],
                      [run(old="passed", coin="failed")] * 2)
    assert (unrelated.failure, unrelated.flaky) == ("fail_to_pass_empty", ["coin"])
    assert unrelated.reason == "no test fails before the gold patch and passes after it (FAIL_TO_PASS is empty)"


def test_runs_without_trusted_per_test_results_make_the_task_invalid() -> None:
    good = run(old="passed", new="passed")
    blind = schema.TestReport(runner="make check", itemised=False, summary_passed=2, summary_failed=0)
    assert split([blind], [good]).reason.startswith("run 1 before the gold patch: the runner's per-test results")
    assert split([blind], [good]).failure == "tests_not_usable"
    assert split([run(new="failed")], [None]).reason == "run 1 after the gold patch gave no test results"
    assert not split([], [good]).valid
    # Before the fix nothing may pass at all (the new module does not import): still a task.
    assert split([run(new="error")], [good]).fail_to_pass == ["new", "old"]


_OUTCOMES = st.sampled_from(["passed", "failed", "error", "skipped"])
_RUN = st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e"]), _OUTCOMES, min_size=1)


@given(st.lists(_RUN, min_size=1, max_size=4), st.lists(_RUN, min_size=1, max_size=4))
def test_the_split_is_stable_and_disjoint(before: list[dict[str, str]], after: list[dict[str, str]]) -> None:
    result = split([run(**r) for r in before], [run(**r) for r in after])
    f2p, p2p, flaky = set(result.fail_to_pass), set(result.pass_to_pass), set(result.flaky)
    assert result.valid == (result.failure is None) == bool(f2p)
    assert not (f2p & p2p) and not (f2p & flaky) and not (p2p & flaky)
    for name in f2p | p2p:  # each passed in every run after the fix
        assert all(r.get(name) == "passed" for r in after)
    for name in f2p:  # and never before it
        assert all(r.get(name) != "passed" for r in before)
    for name in p2p:
        assert all(r.get(name) == "passed" for r in before)
