"""Every test can fail: each test function asserts something (an ``assert``, ``pytest.raises``/``warns``/``fail``,
or a call to a helper of its module that does), and no assertion is true whatever the code does (a truthy
constant, a value compared with itself, a count or length compared ``>= 0``, ``... or True``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_CHECKS = {"raises", "warns", "fail", "deprecated_call"}


def _tests(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            yield node


def _asserts(node: ast.AST, helpers: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _CHECKS \
                and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "pytest":
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in helpers:
            return True
    return False


def _asserting_helpers(tree: ast.Module) -> set[str]:
    """The module's non-test functions that assert, directly or through one another."""
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and not n.name.startswith("test")]
    helpers: set[str] = set()
    while True:
        more = {d.name for d in defs if d.name not in helpers and _asserts(d, helpers)}
        if not more:
            return helpers
        helpers |= more


def _always_true(test: ast.expr) -> str | None:
    if isinstance(test, ast.Constant) and test.value:
        return "a truthy constant"
    if isinstance(test, ast.BoolOp):
        if isinstance(test.op, ast.Or) and any(_always_true(v) for v in test.values):
            return "an 'or' with an always-true operand"
        if isinstance(test.op, ast.And) and all(_always_true(v) for v in test.values):
            return "an 'and' of always-true operands"
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        if isinstance(op, ast.Eq | ast.Is | ast.GtE | ast.LtE) and ast.dump(left) == ast.dump(right):
            return "a value compared with itself"
        if isinstance(op, ast.GtE) and isinstance(right, ast.Constant) and right.value == 0 and (
                isinstance(left, ast.Attribute | ast.Name)
                or (isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "len")):
            return "a count compared >= 0"
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance" \
            and len(test.args) == 2 and isinstance(test.args[1], ast.Name) and test.args[1].id == "object":
        return "isinstance(..., object)"
    return None


def problems(source: str, name: str) -> list[str]:
    tree = ast.parse(source)
    helpers = _asserting_helpers(tree)
    found = [f"{name}:{t.lineno} {t.name} asserts nothing" for t in _tests(tree) if not _asserts(t, helpers)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and (why := _always_true(node.test)):
            found.append(f"{name}:{node.lineno} an assertion that always holds ({why})")
    return found


def test_every_test_asserts_and_no_assertion_always_holds() -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50  # the walk found the suite
    found = [p for f in files for p in problems(f.read_text(), str(f.relative_to(TESTS)))]
    assert found == []


def test_the_checker_catches_what_it_claims() -> None:
    source = '''
import contextlib, pytest
def test_suppressed():
    with contextlib.suppress(ValueError):
        int("x")
async def test_nothing():
    pass
def test_counts(report):
    assert report.passed >= 0 and report.failed >= 0
def test_ok(x):
    assert x == x
def test_raises():
    with pytest.raises(ValueError):
        int("x")
def test_real(x):
    assert x + 1 == 2 or True
def test_fine(report):
    assert report.passed >= 1
def _check(x):
    assert x
async def _via(x):
    _check(x)
async def test_helper(x):
    await _via(x)
def _quiet(x):
    return x
def test_quiet_helper(x):
    _quiet(x)
'''
    found = problems(source, "t.py")
    assert found == ["t.py:3 test_suppressed asserts nothing", "t.py:6 test_nothing asserts nothing",
                     "t.py:27 test_quiet_helper asserts nothing",
                     "t.py:9 an assertion that always holds (an 'and' of always-true operands)",
                     "t.py:11 an assertion that always holds (a value compared with itself)",
                     "t.py:16 an assertion that always holds (an 'or' with an always-true operand)"]
