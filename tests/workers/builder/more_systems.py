"""One generated repository per build system and runner issue 50 added (what stopped projects kiln had never
seen): Maven with JUnit from Maven Central, Gradle (Debian's 4.4.1) and a Gradle newer than it, meson, a suite in
a subdirectory beside a docs build, uvu, ava, jasmine, QUnit and node-tap, a cargo suite with a trybuild-style
nested harness. ``EXPECTED`` says what the build must report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.ingest.gitrepos import Builder, write

CALC_JAVA = """package com.example;

public class Calc {
    public static int add(int a, int b) {
        return a + b;
    }

    public static int mul(int a, int b) {
        if (a == 0) {
            return 0;
        }
        return a * b;
    }
}
"""
CALC_TEST_JAVA = """package com.example;

import static org.junit.Assert.assertEquals;

import org.junit.Test;

public class CalcTest {
    @Test
    public void adds() {
        assertEquals(5, Calc.add(2, 3));
    }

    @Test
    public void multiplies() {
        assertEquals(6, Calc.mul(2, 3));
    }
}
"""
POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>com.example</groupId>
  <artifactId>calc</artifactId>
  <version>1.0.0</version>
  <properties>
    <maven.compiler.source>1.8</maven.compiler.source>
    <maven.compiler.target>1.8</maven.compiler.target>
    <project.build.sourceEncoding>UTF-8</project.build.sourceEncoding>
  </properties>
  <dependencies>
    <dependency>
      <groupId>junit</groupId>
      <artifactId>junit</artifactId>
      <version>4.13.2</version>
      <scope>test</scope>
    </dependency>
  </dependencies>
  <build>
    <plugins>
      <plugin>
        <groupId>org.apache.maven.plugins</groupId>
        <artifactId>maven-surefire-plugin</artifactId>
        <version>3.2.5</version>
      </plugin>
    </plugins>
  </build>
</project>
"""


def _commit(path: Path, files: dict[str, str], message: str) -> Builder:
    b = Builder(path)
    for name, text in files.items():
        write(path, name, text)
    b.commit(message)
    return b


def _java_sources(path: Path) -> None:
    write(path, "src/main/java/com/example/Calc.java", CALC_JAVA)
    write(path, "src/test/java/com/example/CalcTest.java", CALC_TEST_JAVA)


def maven_project(path: Path) -> Builder:
    """Two JUnit 4 tests; junit (and hamcrest) from Maven Central through the egress proxy."""
    b = Builder(path)
    write(path, "pom.xml", POM)
    _java_sources(path)
    b.commit("a Maven project")
    return b


def maven_java5_project(path: Path) -> Builder:
    """The Maven project written for Java 5 (as old poms are), which JDK 17 no longer compiles."""
    return _commit(path, {"pom.xml": POM.replace(">1.8</maven.compiler", ">1.5</maven.compiler"),
                          "src/main/java/com/example/Calc.java": CALC_JAVA,
                          "src/test/java/com/example/CalcTest.java": CALC_TEST_JAVA}, "a Maven project for Java 5")


def gradle_project(path: Path) -> Builder:
    """The same tests under Gradle, with nothing that needs a Gradle newer than Debian's 4.4.1."""
    b = Builder(path)
    write(path, "build.gradle", "apply plugin: 'java'\n\nsourceCompatibility = 1.8\ntargetCompatibility = 1.8\n\n"
                                "repositories {\n    mavenCentral()\n}\n\ndependencies {\n"
                                "    testImplementation 'junit:junit:4.13.2'\n}\n")
    write(path, "settings.gradle", "rootProject.name = 'calc'\n")
    _java_sources(path)
    b.commit("a Gradle project")
    return b


def gradle_wrapper_project(path: Path) -> Builder:
    """A wrapper asking for Gradle 8.5: its distribution cannot be fetched, and 4.4.1 is no stand-in for it."""
    b = Builder(path)
    write(path, "build.gradle", "plugins {\n    id 'java'\n}\n")
    write(path, "gradle/wrapper/gradle-wrapper.properties",
          "distributionUrl=https\\://services.gradle.org/distributions/gradle-8.5-bin.zip\n")
    _java_sources(path)
    b.commit("a project on Gradle 8.5")
    return b


CALC_C = "int add(int a, int b) {\n  return a + b;\n}\n\nint mul(int a, int b) {\n  return a * b;\n}\n"
CALC_TEST_C = """#include <stdio.h>
#include <string.h>
int add(int a, int b);
int mul(int a, int b);
int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "mul") == 0) return mul(2, 3) != 6;
  return add(2, 3) != 5;
}
"""


def meson_project(path: Path) -> Builder:
    """Two meson tests of one program."""
    b = Builder(path)
    write(path, "meson.build", "project('calc', 'c')\ncalc_test = executable('calc_test', 'calc.c', 'calc_test.c')\n"
                               "test('adds', calc_test)\ntest('multiplies', calc_test, args: ['mul'])\n")
    write(path, "calc.c", CALC_C)
    write(path, "calc_test.c", CALC_TEST_C)
    b.commit("a meson project")
    return b


YAML_TEST_C = """#include <string.h>
#include <yaml.h>
int main(int argc, char **argv) {
  if (argc > 1) return strncmp(yaml_get_version_string(), "0.", 2) != 0;
  int major, minor, patch;
  yaml_get_version(&major, &minor, &patch);
  return major != 0;
}
"""


YAML_MAKE_TEST_C = """#include <stdio.h>
#include <string.h>
#include <yaml.h>
int main(void) {
    int major, minor, patch, ok = 0;
    yaml_get_version(&major, &minor, &patch);
    ok += major == 0;
    printf("%s: version\\n", major == 0 ? "PASS" : "FAIL");
    ok += strncmp(yaml_get_version_string(), "0.", 2) == 0;
    printf("%s: version string\\nTests passed: %d\\n", ok == 2 ? "PASS" : "FAIL", ok);
    return ok == 2 ? 0 : 1;
}
"""


def make_system_header_project(path: Path) -> Builder:
    """A make-driven test program including a header of a library the toolchain image lacks (<yaml.h>): the rules
    install Debian's package that ships it."""
    return _commit(path, {"Makefile": "yaml_test: yaml_test.c\n\t$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) -lyaml\n\n"
                                      "test: yaml_test\n\t./yaml_test\n\n.PHONY: test\n",
                          "yaml_test.c": YAML_MAKE_TEST_C}, "a make project on a system header")


def meson_system_library_project(path: Path) -> Builder:
    """A meson test program linking a library the toolchain image lacks (libyaml, by its pkg-config name): the
    rules install Debian's package that ships yaml-0.1.pc."""
    return _commit(path, {"meson.build": "project('y', 'c')\nyaml = dependency('yaml-0.1')\n"
                                         "t = executable('yaml_test', 'yaml_test.c', dependencies: yaml)\n"
                                         "test('version', t)\ntest('version string', t, args: ['s'])\n",
                          "yaml_test.c": YAML_TEST_C}, "a meson project on a system library")


SUITE_C = """#include <stdio.h>
int add(int a, int b);
int mul(int a, int b);
int main(void) {
  int failed = 0;
  if (add(2, 3) == 5) printf("PASS: adds\\n"); else { printf("FAIL: adds\\n"); failed++; }
  if (mul(2, 3) == 6) printf("PASS: multiplies\\n"); else { printf("FAIL: multiplies\\n"); failed++; }
  printf("Tests passed: %d\\nTests failed: %d\\n", 2 - failed, failed);
  return failed != 0;
}
"""


def subdirectory_suite_project(path: Path) -> Builder:
    """Nothing to build at the root; CI runs ``make -C tests`` in its test job, after a docs job whose Sphinx
    build cannot run here (real: the repository the agent gave up on after the docs build)."""
    files = {"src/calc.c": CALC_C, "tests/suite.c": SUITE_C,
             "tests/Makefile": "all: suite\n\t./suite\n\nsuite: suite.c ../src/calc.c\n\t$(CC) $(CFLAGS) -o $@ $^ "
                               "$(LDFLAGS)\n\n.PHONY: all\n",
             "docs/Makefile": "html:\n\tsphinx-build -b html . _build\n",
             ".github/workflows/ci.yml": "jobs:\n  docs:\n    steps:\n      - run: pip install sphinx\n"
                                         "      - run: make -C docs html\n  test:\n    steps:\n"
                                         "      - run: make -C tests\n"}
    return _commit(path, files, "a test suite in tests/")


# The JavaScript runners: (scripts.test, the runner's package and version, the test files). uvu prints a dot per
# test and names only failures, jasmine dots and failures (kiln's reporters name each); ava and QUnit are run with
# their TAP reporter (ava's keeps the code under test's output out of it; QUnit's shares stdout with it).
UVU_TEST = """const { test } = require('uvu');
const assert = require('uvu/assert');
const { add, mul } = require('../calc.js');
test('adds', () => { assert.is(add(2, 3), 5); });
test('multiplies', () => { assert.is(mul(2, 3), 6); });
test.run();
"""
AVA_TEST = """const test = require('ava');
const { add, mul } = require('../calc.js');
test('adds', t => { t.is(add(2, 3), 5); });
test('multiplies', t => { t.is(mul(2, 3), 6); });
"""
JASMINE_SPEC = """const { add, mul } = require('../calc.js');
describe('calc', () => {
  it('adds', () => { expect(add(2, 3)).toBe(5); });
  it('multiplies', () => { expect(mul(2, 3)).toBe(6); });
});
"""
QUNIT_TEST = """const { add, mul } = require('../calc.js');
QUnit.module('calc');
QUnit.test('adds', a => { a.equal(add(2, 3), 5); });
QUnit.test('multiplies', a => { a.equal(mul(2, 3), 6); });
"""
# node-tap: its subtests are the tests, the assertions inside them none.
NODE_TAP_TEST = """const t = require('tap');
const { add, mul } = require('../calc.js');
t.test('adds', t => { t.equal(add(2, 3), 5); t.equal(add(0, 3), 3); t.end(); });
t.test('multiplies', t => { t.equal(mul(2, 3), 6); t.end(); });
"""
JS_RUNNERS: dict[str, tuple[str, str, str, dict[str, str]]] = {
    "uvu": ("uvu tests", "uvu", "0.5.6", {"tests/calc.js": UVU_TEST}),
    "ava": ("ava --verbose", "ava", "6.1.3", {"test/calc.test.js": AVA_TEST}),
    "jasmine": ("jasmine --parallel=auto", "jasmine", "5.1.0", {
        "spec/support/jasmine.json": '{"spec_dir": "spec", "spec_files": ["**/*[sS]pec.js"]}\n',
        "spec/calcSpec.js": JASMINE_SPEC}),
    "qunit": ("qunit", "qunit", "2.21.0", {"test/calc.js": QUNIT_TEST}),
    "tap": ("tap --100", "tap", "16.3.10", {"test/calc.js": NODE_TAP_TEST}),
}


def js_runner_project(runner: str, version_asked: str | None = None) -> Callable[[Path], Builder]:
    """``version_asked``: a version range of the runner the registry serves no version of (a release after the
    registry's newest): the install is retried with the range widened to its major."""
    script, package, version, tests = JS_RUNNERS[runner]
    version = version_asked or version

    def make(path: Path) -> Builder:
        return _commit(path, {"package.json": json.dumps({"name": "calc", "version": "1.0.0", "scripts": {
            "test": script}, "devDependencies": {package: version}}) + "\n", "calc.js":
            "module.exports = { add: (a, b) => a + b, mul: (a, b) => a * b };\n", **tests}, f"a {runner} suite")

    return make


# A UI-test harness run inside one libtest test, printing its cases as trybuild does: straight to stderr (libtest
# captures print! and eprint!, not writes to the stream itself), "test <file> [should …] ... ok".
NESTED_HARNESS_RS = r"""use std::io::Write;

#[test]
fn ui() {
    let cases = [("tests/ui/adds.rs", "should pass", calc::add(2, 3) == 5),
                 ("tests/ui/mul-overflow.rs", "should fail to compile", true),
                 ("tests/ui/mul.rs", "should pass", calc::mul(2, 3) == 6)];
    let mut err = std::io::stderr();
    writeln!(err).unwrap();
    for (file, expected, ok) in cases {
        writeln!(err, "test {file} [{expected}] ... {}", if ok { "ok" } else { "mismatch" }).unwrap();
        assert!(ok, "{file}");
    }
    writeln!(err).unwrap();
}
"""


NESTED_LIB_RS = """pub fn add(a: i32, b: i32) -> i32 {
    a + b
}

pub fn mul(a: i32, b: i32) -> i32 {
    a * b
}

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        assert_eq!(super::add(2, 3), 5);
    }

    #[test]
    fn multiplies() {
        assert_eq!(super::mul(2, 3), 6);
    }
}
"""


def nested_harness_project(path: Path) -> Builder:
    """Two unit tests and one libtest test (``ui``) running three cases of its own: 3 tests, 3 passed by libtest's
    summaries, and the harness's three lines no case (before, the check rejected the honest suite)."""
    return _commit(path, {"Cargo.toml": '[package]\nname = "calc"\nversion = "0.1.0"\nedition = "2021"\n',
                          "src/lib.rs": NESTED_LIB_RS, "tests/ui.rs": NESTED_HARNESS_RS},
                   "a cargo suite with a nested harness")


MORE_PROJECTS: dict[str, Callable[[Path], Builder]] = {
    "maven": maven_project, "gradle": gradle_project, "gradle-8": gradle_wrapper_project, "meson": meson_project,
    "meson-system-library": meson_system_library_project, "maven-java5": maven_java5_project,
    "uvu-version-ahead": js_runner_project("uvu", "^0.5.99"), "make-system-header": make_system_header_project,
    "subdirectory-suite": subdirectory_suite_project,
    **{runner: js_runner_project(runner) for runner in JS_RUNNERS},
    "nested-harness": nested_harness_project,
}
# name -> (usable, failure class, tests passed, runner)
EXPECTED: dict[str, tuple[bool, str | None, int | None, str | None]] = {
    "maven": (True, None, 2, "maven"), "gradle": (True, None, 2, "gradle"),
    "gradle-8": (False, "toolchain_unavailable", None, None), "meson": (True, None, 2, "meson test"),
    "meson-system-library": (True, None, 2, "meson test"), "maven-java5": (True, None, 2, "maven"),
    "uvu-version-ahead": (True, None, 2, "uvu"), "make-system-header": (True, None, 2, "make check"),
    "subdirectory-suite": (True, None, 2, "make check"), "uvu": (True, None, 2, "uvu"), "ava": (True, None, 2, "ava"),
    "jasmine": (True, None, 2, "jasmine"), "qunit": (True, None, 2, "qunit"), "tap": (True, None, 2, "tap"),
    "nested-harness": (True, None, 3, "cargo test"),
}
