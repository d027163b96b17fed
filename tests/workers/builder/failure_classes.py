"""One generated repository per failure class the builder met on real repositories (issue 18): each reproduces
what broke the rules before, and ``EXPECTED_OUTCOME`` says what the build must report now."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.ingest.gitrepos import Builder, write
from tests.workers.builder.projects import CMAKELISTS, LIB_RS, MAKEFILE, PYPROJECT, TEST_CALC_PY, _c_sources

CALC_PY = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"


def npm_prepare_project(path: Path) -> Builder:
    """Class 1: a ``prepare`` script builds lib/ from src/ (TypeScript does this): it fails without the sources."""
    b = Builder(path)
    write(path, "package.json", '{"name": "calc", "version": "1.0.0", "main": "lib/calc.js", '
                                '"scripts": {"prepare": "node build.js", "test": "node --test"}}\n')
    write(path, "build.js", "const fs = require('fs');\nfs.mkdirSync('lib', { recursive: true });\n"
                            "fs.copyFileSync('src/calc.js', 'lib/calc.js');\n")
    write(path, "src/calc.js", "module.exports = { add: (a, b) => a + b };\n")
    write(path, "test/calc.test.js", "const test = require('node:test');\nconst assert = require('node:assert');\n"
                                     "const { add } = require('../lib/calc.js');\n"
                                     "test('adds', () => { assert.strictEqual(add(2, 3), 5); });\n")
    b.commit("npm package with a prepare build")
    return b


def npm_dev_tools_project(path: Path) -> Builder:
    """Class 1 too (real: qs, side-channel): a dev dependency that cannot be installed here (a dist-tag the
    registry lacks) and a pretest lint hook that fails; the tests need neither."""
    b = Builder(path)
    write(path, "package.json", '{"name": "calc", "version": "1.0.0", "scripts": {"pretest": "exit 3", '
                                '"test": "node --test"}, "devDependencies": {"left-pad": "kiln-no-such-tag"}}\n')
    write(path, "calc.js", "module.exports = { add: (a, b) => a + b };\n")
    write(path, "test/calc.test.js", "const test = require('node:test');\nconst assert = require('node:assert');\n"
                                     "const { add } = require('../calc.js');\n"
                                     "test('adds', () => { assert.strictEqual(add(2, 3), 5); });\n")
    b.commit("npm package with dev tools the tests do not need")
    return b


def cargo_dev_deps_project(path: Path) -> Builder:
    """Class 2 (and 9): a workspace member, a dev-dependency used by an integration test, a ``harness = false``
    bench with an explicit path, no Cargo.lock: four tests (two unit, one integration, one doc test)."""
    b = Builder(path)
    write(path, "Cargo.toml", '[package]\nname = "calc"\nversion = "0.1.0"\nedition = "2021"\n\n'
                              '[workspace]\nmembers = ["inner"]\n\n[dependencies]\ninner = { path = "inner" }\n\n'
                              '[dev-dependencies]\nitoa = "1"\n\n[[bench]]\nname = "speed"\npath = "benches/speed.rs"\n'
                              'harness = false\n')
    write(path, "inner/Cargo.toml", '[package]\nname = "inner"\nversion = "0.1.0"\nedition = "2021"\n')
    write(path, "inner/src/lib.rs", "pub fn two() -> i32 {\n    2\n}\n")
    write(path, "src/lib.rs", "/// ```\n/// assert_eq!(calc::add(1, 1), 2);\n/// ```\n" + LIB_RS.replace(
        "pub fn sub", "pub fn double(a: i32) -> i32 {\n    a * inner::two()\n}\n\npub fn sub"))
    write(path, "tests/format.rs", "#[test]\nfn formats_a_sum() {\n    let mut buf = itoa::Buffer::new();\n"
                                   "    assert_eq!(buf.format(calc::add(40, 2)), \"42\");\n}\n")
    write(path, "benches/speed.rs", "fn main() {\n    println!(\"{}\", calc::double(21));\n}\n")
    b.commit("cargo workspace with dev-dependencies")
    return b


SCM_PYPROJECT = """[project]
name = "calc"
dynamic = ["version"]
requires-python = ">=3.9"

[build-system]
requires = ["setuptools>=64", "setuptools-scm>=8"]
build-backend = "setuptools.build_meta"

[tool.setuptools]
packages = ["calc"]

[tool.setuptools_scm]
"""


def scm_version_project(path: Path) -> Builder:
    """Class 3: the version comes from git (setuptools-scm); a build context has no ``.git``."""
    b = Builder(path)
    write(path, "pyproject.toml", SCM_PYPROJECT)
    write(path, "calc/__init__.py", CALC_PY)
    write(path, "tests/test_version.py", "from importlib.metadata import version\n\n\n"
                                         "def test_version_is_the_tag():\n    assert version('calc') == '1.2.0'\n")
    b.commit("a project versioned by its tags")
    b("tag", "v1.2.0")
    return b


def test_group_project(path: Path) -> Builder:
    """Class 4: the tests need a PEP 735 dependency group (and a requirements file) the project itself does not."""
    b = Builder(path)
    write(path, "pyproject.toml", PYPROJECT + '\n[dependency-groups]\ntest = ["toolz>=0.12"]\n')
    write(path, "requirements/test.txt", "iniconfig\n")
    write(path, "calc/__init__.py", CALC_PY)
    write(path, "tests/test_calc.py", "import iniconfig  # noqa: F401\nimport toolz\n\nfrom calc import add\n\n\n"
                                      "def test_add_folds():\n    assert toolz.reduce(add, [1, 2, 3]) == 6\n")
    b.commit("tests with their own dependencies")
    return b


def collection_error_project(path: Path) -> Builder:
    """Class 4: a test module that cannot be imported; before, the build counted as usable with 0 passed."""
    b = Builder(path)
    write(path, "pyproject.toml", PYPROJECT)
    write(path, "calc/__init__.py", CALC_PY)
    write(path, "tests/test_calc.py", "import not_installed_anywhere\n\n\ndef test_x():\n    assert True\n")
    b.commit("a test module that does not import")
    return b


def unusable_dockerfile_project(path: Path) -> Builder:
    """Class 6: a Dockerfile on a base with no local stand-in next to a CMakeLists.txt."""
    b = Builder(path)
    _c_sources(path)
    write(path, "CMakeLists.txt", CMAKELISTS)
    write(path, "Dockerfile", "FROM alpine:3.19\nRUN apk add build-base cmake\nCOPY . /src\n")
    b.commit("cmake project with an alpine Dockerfile")
    return b


def test_binary_project(path: Path) -> Builder:
    """Class 7: no test target; the README says to run the binary ``make`` builds."""
    b = Builder(path)
    _c_sources(path)
    write(path, "Makefile", "all: calc-test\n\ncalc-test: calc.o test_calc.o\n\t$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS)\n")
    write(path, "README.md", "# calc\n\nBuild and run the tests:\n\n```sh\nmake && ./calc-test\n```\n")
    b.commit("make project whose README names its test binary")
    return b


GO_CALC = """package calc

func Add(a, b int) int {
	return a + b
}
"""
GO_CALC_TEST = """package calc

import "testing"

func TestAdd(t *testing.T) {
	if Add(2, 3) != 5 {
		t.Fatal("add")
	}
}
"""
GO_EXAMPLE_TEST = """package calc_test

import (
	"fmt"

	"github.com/acme/calc"
)

func ExampleAdd() {
	fmt.Println(calc.Add(1, 2))
	// Output: 3
}
"""


def make_task_runner_project(path: Path) -> Builder:
    """A Python project whose CI runs ``make`` targets that need the network (real: more-itertools): make is
    chosen, fails to build, and the python rules build it instead."""
    b = Builder(path)
    write(path, "pyproject.toml", PYPROJECT)
    write(path, "calc/__init__.py", CALC_PY)
    write(path, "tests/test_calc.py", TEST_CALC_PY)
    write(path, "Makefile", "all: requirements\n\nrequirements:\n\tcurl -sf https://example.invalid/reqs.txt\n\n"
                            "check:\n\tpython3 -m pytest tests\n")
    write(path, ".github/workflows/ci.yml", "jobs:\n  build:\n    steps:\n      - run: make requirements\n"
                                            "      - run: make check\n")
    b.commit("a Makefile as a task runner")
    return b


def go_without_module_project(path: Path) -> Builder:
    """A Go package from before modules (real: pkg/errors' module zip): no go.mod; the example test imports the
    package by its path."""
    b = Builder(path)
    write(path, "calc.go", GO_CALC)
    write(path, "calc_test.go", GO_CALC_TEST)
    write(path, "example_test.go", GO_EXAMPLE_TEST)
    b.commit("a Go package without go.mod")
    return b


# Issue 34: suites whose per-test results a build must read, or say it could not.
MOCHA_TEST = """const assert = require('assert');
const { add } = require('../calc.js');
describe('calc', () => {
  it('adds', () => { assert.strictEqual(add(2, 3), 5); });
  it('adds zero', () => { assert.strictEqual(add(0, 3), 3); });
  it.skip('adds strings', () => {});
});
"""


def mocha_project(path: Path) -> Builder:
    """A mocha suite behind a lint step (real: the npm projects that folded into one "npm test suite"): kiln runs
    mocha itself with its xunit reporter writing to a file; the spec output would print a forgeable "2 passing"."""
    b = Builder(path)
    write(path, "package.json", '{"name": "calc", "version": "1.0.0", "scripts": {"lint": "exit 3", '
                                '"test": "npm run lint && mocha --reporter spec"}, '
                                '"devDependencies": {"mocha": "10.8.2"}}\n')
    write(path, "calc.js", "module.exports = { add: (a, b) => a + b };\n")
    write(path, "test/calc.test.js", MOCHA_TEST)
    b.commit("a mocha suite")
    return b


def jest_project(path: Path) -> Builder:
    """A jest suite (jest prints its human summary on stderr): kiln runs jest with ``--json --outputFile``."""
    b = Builder(path)
    write(path, "package.json", '{"name": "calc", "version": "1.0.0", "scripts": {"test": "jest --coverage"}, '
                                '"devDependencies": {"jest": "29.7.0"}}\n')
    write(path, "calc.js", "module.exports = { add: (a, b) => a + b };\n")
    write(path, "calc.test.js", "const { add } = require('./calc.js');\n"
                                "test('adds', () => { expect(add(2, 3)).toBe(5); });\n"
                                "test('adds zero', () => { expect(add(0, 3)).toBe(3); });\n"
                                "test.todo('adds strings');\n")
    b.commit("a jest suite")
    return b


def vitest_project(path: Path) -> Builder:
    """A vitest suite, watch mode by default: kiln runs it once with its JSON reporter writing to a file."""
    b = Builder(path)
    write(path, "package.json", '{"name": "calc", "version": "1.0.0", "type": "module", "scripts": '
                                '{"test": "vitest"}, "devDependencies": {"vitest": "1.6.0"}}\n')
    write(path, "calc.js", "export const add = (a, b) => a + b;\n")
    write(path, "calc.test.js", "import { expect, test } from 'vitest';\nimport { add } from './calc.js';\n"
                                "test('adds', () => { expect(add(2, 3)).toBe(5); });\n"
                                "test('adds zero', () => { expect(add(0, 3)).toBe(3); });\n"
                                "test.skip('adds strings', () => {});\n")
    b.commit("a vitest suite")
    return b


SUMMARY_ONLY_C = """#include <stdio.h>
int add(int a, int b);
int main(void) {
    int passed = 0;
    for (int i = 0; i < 349; i++) passed += add(i, 1) == i + 1;
    printf("Tests passed: %d\\n", passed);
    return passed == 349 ? 0 : 1;
}
"""
PER_TEST_C = """#include <stdio.h>
int add(int a, int b);
static int passed, failed;
static void check(const char *name, int ok) {
    printf("%s: %s\\n", name, ok ? "PASSED" : "FAILED");
    ok ? passed++ : failed++;
}
int main(void) {
    check("adds", add(2, 3) == 5);
    check("adds_zero", add(0, 3) == 3);
    check("adds_negatives", add(-2, -3) == -5);
    printf("%d tests passed\\n", passed);
    return failed != 0;
}
"""


def summary_only_project(path: Path) -> Builder:
    """A C project whose ``make test`` prints only "Tests passed: 349": no per-test results, so not usable — the
    summary is in the event."""
    b = Builder(path)
    _c_sources(path)
    write(path, "test_calc.c", SUMMARY_ONLY_C)
    write(path, "Makefile", MAKEFILE)
    b.commit("a suite that prints only its count")
    return b


def binary_target_project(path: Path) -> Builder:
    """A Makefile whose only target is the test binary, which prints one line per test; the README is silent (was
    ``no_rule_matched`` with an empty agent detail)."""
    b = Builder(path)
    write(path, "calc.c", "int add(int a, int b) {\n  return a + b;\n}\n")
    write(path, "calc_test.c", PER_TEST_C)
    write(path, "Makefile", "calc_test: calc.o calc_test.o\n\t$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS)\n")
    write(path, "README.md", "# calc\n\nA small adder.\n")
    b.commit("a Makefile whose target is the test binary")
    return b


def tox_project(path: Path) -> Builder:
    """CI's only ``pytest`` line is a benchmark job; the test job runs tox, whose testenv runs ``pytest tests``
    (real: a Python project whose tests were never run). The benchmarks fail here (no plugin). As in Pallets'
    sdists (real: Flask, click), the testenv installs one requirement file while another names a file left out of
    the test dependencies (dev.in: ``-r docs.txt``), and passes ``--basetemp={envtmpdir}``; its pytest command is
    continued over three lines."""
    b = Builder(path)
    write(path, "pyproject.toml", PYPROJECT)
    write(path, "calc/__init__.py", CALC_PY)
    write(path, "tests/test_calc.py", TEST_CALC_PY)
    write(path, "benchmarks/test_speed.py", "def test_speed(benchmark):\n    benchmark(sum, [1, 2])\n")
    write(path, "requirements/tests.txt", "pytest\n")
    write(path, "requirements/dev.in", "-r docs.txt\n-r tests.txt\n")
    write(path, "requirements/docs.txt", "kiln-no-such-docs-tool==0.0.1\n")
    # One command continued over lines, as tox joins it (real: "{envpython} -m pytest \" was cut at the backslash).
    write(path, "tox.ini", "[tox]\nenvlist = py311\n\n[testenv]\ndeps =\n    -r requirements/tests.txt\n"
                           "commands =\n    {envpython} -m pip list\n    {envpython} -m pytest \\\n"
                           "        tests --basetemp={envtmpdir} \\\n        {posargs}\n")
    write(path, ".github/workflows/ci.yml", "jobs:\n  benchmarks:\n    steps:\n      - run: pytest benchmarks "
                                            "--benchmark-only\n  tests:\n    steps:\n      - run: pip install tox"
                                            "\n      - run: tox -e py311\n")
    b.commit("tested through tox")
    return b


LD_WRAP_MAKEFILE = """calc_test: calc.o calc_test.o
\t$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) -Wl,--wrap,open

test: teststatic testrepeat

teststatic: calc_test
\t@if ./calc_test; then echo '\t\t*** calc test OK ***'; else echo '\t\t*** calc test FAILED ***'; false; fi

testrepeat: calc_test
\t@if ./calc_test && ./calc_test; then echo '\t\t*** calc repeated test OK ***'; \\
\telse echo '\t\t*** calc repeated test FAILED ***'; false; fi

.PHONY: test teststatic testrepeat
"""


def ld_wrap_project(path: Path) -> Builder:
    """Two classes of real C projects in one. Its test program links with ``-Wl,--wrap,open`` (a mock the tests
    need on some platforms; real: libxcrypt 4.4.33's getrandom-fallbacks): gcov's runtime calls ``open`` too, so
    built with --coverage it does not link, and was a failed build. And, like zlib's, ``make test`` prints one
    banner per target, "*** calc test OK ***", among the program's own progress lines: its only verdicts (zlib was
    ``tests_not_itemised``)."""
    b = Builder(path)
    write(path, "calc.c", "int add(int a, int b) {\n  return a + b;\n}\n")
    write(path, "calc_test.c", '#include <stdio.h>\nint add(int a, int b);\nint main(void) {\n'
                               '    printf("add(2, 3): %d\\n", add(2, 3));\n    return add(2, 3) != 5;\n}\n')
    write(path, "Makefile", LD_WRAP_MAKEFILE)
    b.commit("a test program linked with ld --wrap, and a banner per make target")
    return b


CLASS_PROJECTS: dict[str, Callable[[Path], Builder]] = {
    "npm-prepare": npm_prepare_project, "cargo-dev-deps": cargo_dev_deps_project,
    "scm-version": scm_version_project, "test-group": test_group_project,
    "collection-error": collection_error_project, "unusable-dockerfile": unusable_dockerfile_project,
    "test-binary": test_binary_project, "make-task-runner": make_task_runner_project,
    "go-without-module": go_without_module_project, "npm-dev-tools": npm_dev_tools_project,
    "mocha": mocha_project, "jest": jest_project, "vitest": vitest_project, "summary-only": summary_only_project,
    "binary-target": binary_target_project, "tox": tox_project, "ld-wrap": ld_wrap_project,
}
# name -> (usable, failure class, tests passed)
EXPECTED_OUTCOME: dict[str, tuple[bool, str | None, int | None]] = {
    "npm-prepare": (True, None, 1), "cargo-dev-deps": (True, None, 4), "scm-version": (True, None, 1),
    "test-group": (True, None, 1), "collection-error": (False, "tests_did_not_run", None),
    "unusable-dockerfile": (True, None, 1), "test-binary": (True, None, 1), "make-task-runner": (True, None, 2),
    "go-without-module": (True, None, 2), "npm-dev-tools": (True, None, 1),
    "mocha": (True, None, 2), "jest": (True, None, 2), "vitest": (True, None, 2),
    "summary-only": (False, "tests_not_itemised", None),
    "binary-target": (True, None, 3),
    "tox": (True, None, 2),
    "ld-wrap": (True, None, 2),
}
