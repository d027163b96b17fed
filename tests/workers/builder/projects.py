"""Small real projects, one per build system, plus an ambiguous and broken ones, with their expected coverage.

Each is a git repository (built with tests.ingest.gitrepos.Builder) so it goes through Saucer like any other.
``EXPECTED`` holds what the unified coverage report must say, worked out by hand from the sources below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from tests.ingest.gitrepos import Builder, write

PYPROJECT = """[project]
name = "calc"
version = "0.1.0"
requires-python = ">=3.9"

[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[tool.setuptools]
packages = ["calc"]
"""

# 8 statements (def add, return, def sub, return, def mul, if, return 0, return a * b); the tests run add and
# mul(2, 3): sub's body and "return 0" never run -> 6 covered.
CALC_PY = """def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    if a == 0:
        return 0
    return a * b
"""

TEST_CALC_PY = """from calc import add, mul


def test_add():
    assert add(2, 3) == 5


def test_mul():
    assert mul(2, 3) == 6
"""

# Blocks with statements: Add 3-5, Abs 7-8 (the if), 8-10 (return -a), 11 (return a): executable lines
# {3,4,5,7,8,9,10,11}; the test runs Add and Abs(2): {3,4,5,7,8,11} covered.
CALC_GO = """package calc

func Add(a, b int) int {
	return a + b
}

func Abs(a int) int {
	if a < 0 {
		return -a
	}
	return a
}
"""

CALC_TEST_GO = """package calc

import "testing"

func TestAdd(t *testing.T) {
	if Add(2, 3) != 5 {
		t.Fatal("add")
	}
}

func TestAbs(t *testing.T) {
	if Abs(2) != 2 {
		t.Fatal("abs")
	}
}
"""

CALC_C = """int add(int a, int b) {
  return a + b;
}

int sub(int a, int b) {
  return a - b;
}
"""

TEST_C = """#include <stdio.h>
int add(int a, int b);
int main(void) {
    int ok = add(2, 3) == 5;
    printf("%s: adds\\nTests passed: %d\\n", ok ? "PASS" : "FAIL", ok);
    return ok ? 0 : 1;
}
"""

# llvm-cov counts function and body lines: add (1-3), sub (5-7, never called), the two tests (12-14, 17-19).
LIB_RS = """pub fn add(a: i32, b: i32) -> i32 {
    a + b
}

pub fn sub(a: i32, b: i32) -> i32 {
    a - b
}

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        assert_eq!(super::add(2, 3), 5);
    }

    #[test]
    fn adds_zero() {
        assert_eq!(super::add(0, 3), 3);
    }
}
"""

EXPECTED = {
    "python": {"tests": 2, "file": "calc/__init__.py", "executable": 8, "covered": 6},
    "go": {"tests": 2, "file": "calc.go", "executable": 8, "covered": 6},
    "cargo": {"tests": 2, "file": "src/lib.rs", "executable": 12, "covered": 9},
}


def python_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "pyproject.toml", PYPROJECT)
    write(path, "calc/__init__.py", CALC_PY)
    write(path, "tests/test_calc.py", TEST_CALC_PY)
    b.commit("python project")
    return b


def go_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "go.mod", "module example.com/calc\n\ngo 1.21\n")
    write(path, "calc.go", CALC_GO)
    write(path, "calc_test.go", CALC_TEST_GO)
    b.commit("go project")
    return b


def cargo_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "Cargo.toml", '[package]\nname = "calc"\nversion = "0.1.0"\nedition = "2021"\n')
    write(path, "src/lib.rs", LIB_RS)
    b.commit("cargo project")
    return b


def npm_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "package.json", '{"name": "calc", "version": "1.0.0", "engines": {"node": ">=18"}, '
                                '"scripts": {"test": "node --test"}}\n')
    write(path, "calc.js", "function add(a, b) {\n  return a + b;\n}\nfunction sub(a, b) {\n  return a - b;\n}\n"
                           "module.exports = { add, sub };\n")
    write(path, "test/calc.test.js", "const test = require('node:test');\nconst assert = require('node:assert');\n"
                                     "const { add } = require('../calc.js');\n"
                                     "test('adds', () => { assert.strictEqual(add(2, 3), 5); });\n"
                                     "test('adds zero', () => { assert.strictEqual(add(0, 3), 3); });\n")
    b.commit("npm project")
    return b


def _c_sources(path: Path) -> None:
    write(path, "calc.c", CALC_C)
    write(path, "test_calc.c", TEST_C)


CMAKELISTS = """cmake_minimum_required(VERSION 3.16)
project(calc C)
enable_testing()
add_library(calc calc.c)
add_executable(test_calc test_calc.c)
target_link_libraries(test_calc calc)
add_test(NAME adds COMMAND test_calc)
"""


def cmake_project(path: Path) -> Builder:
    b = Builder(path)
    _c_sources(path)
    write(path, "CMakeLists.txt", CMAKELISTS)
    b.commit("cmake project")
    return b


MAKEFILE = ("test_calc: calc.o test_calc.o\n\t$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS)\n\n"
            "test: test_calc\n\t./test_calc\n\n.PHONY: test\n")


def make_project(path: Path) -> Builder:
    b = Builder(path)
    _c_sources(path)
    write(path, "Makefile", MAKEFILE)
    b.commit("make project")
    return b


def ambiguous_project(path: Path) -> Builder:
    """A CMake project with a stale generated Makefile that no longer works: CMake must win."""
    b = Builder(path)
    _c_sources(path)
    write(path, "CMakeLists.txt", CMAKELISTS)
    write(path, "Makefile", "# Generated by CMake 2.8 (stale)\nall:\n\t$(MAKE) -f CMakeFiles/Makefile2 all\n"
                            "test:\n\tfalse\n")
    b.commit("cmake with a stale makefile")
    return b


def dockerfile_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "pyproject.toml", PYPROJECT)
    write(path, "calc/__init__.py", CALC_PY)
    write(path, "tests/test_calc.py", TEST_CALC_PY)
    write(path, "Dockerfile", "FROM python:3.11-slim\nRUN pip install --no-cache-dir pytest\nCOPY . /app\n"
                              "WORKDIR /app\nENV PYTHONPATH=/app\n")
    b.commit("python project with its own Dockerfile")
    return b


def broken_compile_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "go.mod", "module example.com/broken\n\ngo 1.21\n")
    write(path, "main.go", "package broken\n\nfunc Broken() int {\n\treturn undefinedThing\n}\n")
    b.commit("does not compile")
    return b


def broken_dependency_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "pyproject.toml", PYPROJECT.replace('requires-python = ">=3.9"',
                                                    'requires-python = ">=3.9"\ndependencies = '
                                                    '["kiln-no-such-package-anywhere==9.9.9"]'))
    write(path, "calc/__init__.py", CALC_PY)
    b.commit("depends on a package that does not exist")
    return b


def no_rule_project(path: Path) -> Builder:
    b = Builder(path)
    write(path, "notes.txt", "just words\n")
    b.commit("nothing to build")
    return b


PROJECTS = {
    "python": python_project, "go": go_project, "cargo": cargo_project, "npm": npm_project,
    "cmake": cmake_project, "make": make_project, "ambiguous": ambiguous_project, "dockerfile": dockerfile_project,
    "broken-compile": broken_compile_project, "broken-deps": broken_dependency_project, "no-rule": no_rule_project,
}


def ingested_store(root: Path, projects: dict[str, Callable[[Path], Builder]], prefix: str) -> SaucerStore:
    """A Saucer store under ``root`` holding every project as ``<prefix>/<name>``."""
    saucer = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
    for name, make in projects.items():
        make(root / "src" / name)
        event = asyncio.run(ingest(IngestRequest(name=f"{prefix}/{name}", location=str(root / "src" / name)),
                                   f"{prefix}-{name}", saucer, root / "work"))
        assert event.status == "ingested", event
    return saucer
