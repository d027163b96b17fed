"""The rules on the failure classes real repositories showed (issue 18), decided from files alone: which CI job
is the test suite, a Dockerfile that cannot be used, test dependencies, versions from VCS metadata, npm lifecycle
scripts, and what the agent may take from a README or CI file."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from kiln.schemas.images import REPORTS_DIR
from kiln.workers.builder.agent import AgentPlan, classify, repair, run_loop
from kiln.workers.builder.errors import PlanError, ToolchainUnavailable
from kiln.workers.builder.rules import describe, npm_runner, plan, readme_commands, with_reporter
from tests.ingest.gitrepos import write


def checkout(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        write(root, rel, text)
    return root


PYPROJECT = "[project]\nname = 'x'\nversion = '1'\n"


def test_the_test_suite_job_wins_over_a_benchmark_job(tmp_path: Path) -> None:
    workflows = {
        ".github/workflows/bench.yml": "name: bench\njobs:\n  benchmarks:\n    steps:\n"
                                       "      - run: pytest tests/test_benchmarks.py --codspeed\n",
        ".github/workflows/tests.yml": "name: tests\njobs:\n  test:\n    strategy:\n      matrix:\n"
                                       "        python: ['3.11', '3.12']\n    steps:\n"
                                       "      - run: echo \"X=1\" >> $GITHUB_ENV\n      - run: pytest -q tests\n",
    }
    p = plan(checkout(tmp_path, {"pyproject.toml": PYPROJECT, **workflows}))
    decision = next(d for d in p.decisions if d.topic == "test command")
    assert decision.choice == "pytest -q tests"
    assert "tests.yml:test" in decision.reason and "preferred over bench.yml:benchmarks" in decision.reason


def test_an_unusable_dockerfile_falls_back_to_the_build_system(tmp_path: Path) -> None:
    p = plan(checkout(tmp_path, {"Dockerfile": "FROM alpine:3.19\nRUN apk add cmake\n",
                                 "CMakeLists.txt": "project(x C)\nenable_testing()\n"}))
    assert p.system == "cmake" and p.recipe == "rules" and p.dockerfile is None
    assert "alpine:3.19" in next(d.reason for d in p.decisions if d.topic == "recipe")


def test_python_test_dependencies_from_every_place_projects_keep_them(tmp_path: Path) -> None:
    files = {
        "pyproject.toml": PYPROJECT + "[project.optional-dependencies]\ntesting = ['pytest-timeout']\n"
                                      "docs = ['sphinx']\n"
                                      "[dependency-groups]\nlint = ['flake8']\ntyping = ['mypy']\n"
                                      "test = ['hypothesis', {include-group = 'typing'}]\n",
        "requirements/test.txt": "toolz\n", "requirements/docs.txt": "furo\n",
        "tox.ini": "[testenv]\ndeps =\n    attrs\n    -rrequirements/test.txt\ncommands = pytest\n",
    }
    p = plan(checkout(tmp_path, files))
    for wanted in ("pytest-timeout", "hypothesis", "mypy", "attrs", "-r requirements/test.txt"):
        assert wanted in p.deps_script, wanted
    for unwanted in ("sphinx", "flake8", "furo"):
        assert unwanted not in p.deps_script, unwanted
    assert {"requirements/test.txt", "tox.ini"} <= set(p.manifests)


def test_versions_from_vcs_metadata_come_from_the_nearest_tag(tmp_path: Path) -> None:
    parents = {"c3": ("c2",), "c2": ("c1",), "c1": ()}
    assert describe(parents, {"v1.4.0": "c1", "nightly": "c3"}, "c3") == "1.4.0.post2+gc3"
    assert describe(parents, {"1.4.0": "c1"}, "c1") == "1.4.0"
    assert describe(parents, {}, "c3") == "0.0.0.post3+gc3"
    scm = PYPROJECT.replace("version = '1'\n", "dynamic = ['version']\n") + (
        "[build-system]\nrequires = ['setuptools>=64', 'setuptools-scm>=8']\nbuild-backend = 'setuptools.build_meta'\n")
    p = plan(checkout(tmp_path, {"pyproject.toml": scm}), "1.4.0.post2+gc3")
    assert p.env["SETUPTOOLS_SCM_PRETEND_VERSION"] == "1.4.0.post2+gc3"
    assert "setuptools-scm" in next(d.reason for d in p.decisions if d.topic == "version")


def test_npm_lifecycle_scripts_run_once_sources_are_in(tmp_path: Path) -> None:
    pkg = '{"name": "x", "scripts": {"prepare": "tsc -p .", "test": "node --test"}}'
    p = plan(checkout(tmp_path, {"package.json": pkg, "package-lock.json": "{}"}))
    assert "npm ci --no-audit --no-fund --ignore-scripts" in p.deps_script
    assert p.build_script == "npm rebuild --no-audit --no-fund && npm run prepare"


README = """# widget

Install it from PyPI and run the test suite. Make sure tests pass.

- run the tests before sending a patch
- `make` builds everything

```python
import widget
```

```
just some text in a block
```

```sh
make
```

```console
$ make check
ok 1 - widget
```
"""


def test_the_agent_reads_shell_blocks_and_prompts_only(tmp_path: Path) -> None:
    root = checkout(tmp_path, {"README.md": README, ".github/workflows/ci.yml":
                               "jobs:\n  t:\n    steps:\n      - run: echo \"RUST=1\" >> $GITHUB_ENV\n"
                               "      - run: cargo +nightly miri test\n      - run: make test\n"})
    assert readme_commands(root) == ["make", "make check"]
    plan_ = classify(root)
    assert plan_.build == ["make"] and plan_.test == ["make check", "make test"]


def test_without_a_model_the_agent_stops_after_a_few_failing_tests(tmp_path: Path) -> None:
    tried: list[str] = []

    def run(command: str) -> tuple[int, str]:
        tried.append(command)
        return 1, "error: no such thing\n"

    built, test, _decisions, output = run_loop(AgentPlan(test=[f"t{i}" for i in range(8)]), run, tmp_path, 20)
    assert not built and test is None and tried == ["t0", "t1", "t2"]
    # What the agent tried is in its answer (the event's detail), never an empty string.
    assert output.startswith("agent: no test command gave per-test results kiln can read; tried:\n$ t0  (exit 1)\n"
                             "$ t1  (exit 1)")
    nothing = run_loop(AgentPlan(), run, tmp_path, 20)
    assert nothing[3] == "the agent found no command to try: no shell block in the README, no CI step"


def test_a_makefile_without_a_test_target_runs_the_test_binary_the_readme_names(tmp_path: Path) -> None:
    readme = "# x\n\nBuild and test:\n\n```sh\nmake && ./x-test --all\n```\n"
    p = plan(checkout(tmp_path / "a", {"Makefile": "all: x-test\nx-test: t.c\n\tcc -o x-test t.c\n",
                                       "README.md": readme}))
    assert p.test_script.startswith("./x-test 2>&1")
    assert "README or CI runs the built ./x-test" in p.decisions[-1].reason
    named = plan(checkout(tmp_path / "b", {"Makefile": "all:\n\ttrue\nunittests: all\n\t./run\n"}))
    assert named.test_script.startswith("make unittests 2>&1")


def test_what_release_artefacts_look_like(tmp_path: Path) -> None:
    # A Go package from before modules: no go.mod; its example test imports it by its path.
    go = plan(checkout(tmp_path / "go", {"errors.go": "package errors\n", "example_test.go":
                                         'package errors_test\n\nimport "github.com/acme/errors"\n'}))
    assert go.system == "go" and go.build_script.startswith("go mod init github.com/acme/errors && go mod edit")
    assert go.env["GOSUMDB"] == "off"
    # A release tarball with both CMake and autotools: CMake first, autotools the fallback.
    both = plan(checkout(tmp_path / "c", {"CMakeLists.txt": "project(x C)\n", "configure": "#!/bin/sh\n",
                                          "Makefile.in": "all:\n"}))
    assert both.system == "cmake" and both.alternatives == ["autotools"]
    fallback = plan(tmp_path / "c", exclude={"cmake"})
    assert fallback.system == "autotools" and fallback.test_script.startswith("make check")
    # Nothing at the root, one directory with a build system (expat's layout).
    nested = plan(checkout(tmp_path / "n", {"README.md": "x\n", "expat/configure": "#!/bin/sh\n",
                                            "expat/configure.ac": "AC_INIT\n", "expat/Makefile.in": "all:\n"}))
    assert nested.system == "autotools" and nested.build_script.startswith("cd expat && ")
    assert nested.decisions[0].topic == "project directory"
    # tox's factor-conditional deps and URLs are not requirements.
    tox = plan(checkout(tmp_path / "t", {"pyproject.toml": PYPROJECT, "tox.ini": "[testenv]\ndeps =\n  attrs\n"
                                         "  coverage: coverage\n  main: git+https://example.invalid/x.git\n"}))
    assert "attrs" in tox.deps_script and "coverage:" not in tox.deps_script and "git+" not in tox.deps_script


def test_a_makefile_whose_only_target_is_the_test_binary_runs_it(tmp_path: Path) -> None:
    makefile = ("CFLAGS = -O2\nall: calc_test\n\ncalc_test: calc.o test.o\n\t$(CC) $(CFLAGS) -o $@ $^\n\n"
                "clean:\n\trm -f *.o\n")
    p = plan(checkout(tmp_path / "a", {"Makefile": makefile}))
    assert (p.build_script, p.test_script.split(" 2>&1")[0]) == ("make calc_test", "./calc_test")
    assert "target 'calc_test' links a test binary" in p.decisions[-1].reason
    # A target named like a test that does not link anything is not a binary to run.
    with pytest.raises(PlanError, match="no target that links a test binary"):
        plan(checkout(tmp_path / "b", {"Makefile": "all:\n\tcc -o app app.c\ncheckstyle:\n\tindent *.c\n"}))


@pytest.mark.parametrize(("scripts", "expected"), [
    ({"test": "mocha --reporter spec test/*.js"},
     f"_mocha test/*.js --reporter xunit --reporter-options output={REPORTS_DIR}/mocha.xml"),
    ({"test": "npm run lint && npm run unit", "lint": "eslint .", "unit": "NODE_ENV=test nyc -x x jest"},
     None),
    ({"test": "npm run lint && npm run unit", "lint": "eslint .", "unit": "NODE_ENV=test nyc jest --coverage"},
     f"NODE_ENV=test jest --coverage --ci --json --outputFile={REPORTS_DIR}/jest.json"),
    ({"test": "vitest"}, f"vitest --run --reporter=default --reporter=json --outputFile.json={REPORTS_DIR}/"
                         "vitest.json"),
    ({"test": "node --test test/"}, f"node --test-reporter=tap --test-reporter-destination={REPORTS_DIR}/"
                                    "node-tap.txt --test-reporter=spec --test-reporter-destination=stdout "
                                    "--test test/"),
    ({"test": "jest --json tests/"}, f"jest tests/ --ci --json --outputFile={REPORTS_DIR}/jest.json"),
    ({"test": "mocha -R dot -O foo=bar test"},
     f"_mocha test --reporter xunit --reporter-options output={REPORTS_DIR}/mocha.xml"),
    # A stop at the first failure hides every later test's result (real: merge-descriptors 1.0.1 on Node 20).
    ({"test": "mocha --reporter spec --bail --check-leaks test/"},
     f"_mocha --check-leaks test/ --reporter xunit --reporter-options output={REPORTS_DIR}/mocha.xml"),
    ({"test": "jest -b --bail=2 tests/"}, f"jest tests/ --ci --json --outputFile={REPORTS_DIR}/jest.json"),
    ({"test": "uvu tests -b"}, f"KILN_UVU_REPORT={REPORTS_DIR}/uvu.tap uvu tests"),
    ({"test": "ava --verbose --fail-fast"}, "ava --verbose --tap"),
    ({"test": "qunit --reporter dot test/"}, "qunit test/ --reporter tap"),
    ({"test": "jasmine --parallel=auto --reporter=./r.js"},
     f"KILN_JASMINE_REPORT={REPORTS_DIR}/jasmine.tap jasmine --helper=/opt/kiln-js/jasmine-report.cjs"),
    ({"test": "tap --100 test/*.js"}, "tap test/*.js -R tap --no-coverage"),
    ({"test": "tape test/*.js | tap-spec"}, None),
    ({"test": "npm test"}, None),
])
def test_npm_runners_get_a_reporter_writing_to_a_file(scripts: dict[str, str], expected: str | None) -> None:
    found = npm_runner(scripts)
    assert (with_reporter(found.runner, found.command) if found else None) == expected


@pytest.mark.parametrize(("scripts", "setup"), [
    ({"test": "bash fixtures.sh && node --test"}, ("bash fixtures.sh",)),
    ({"test": "eslint . && npm run build && mocha", "build": "tsc -p ."}, ("npm run build",)),
    ({"test": "npm run lint && npm run unit", "lint": "eslint .", "unit": "node gen.js && jest"}, ("node gen.js",)),
    ({"test": "prettier --check . && tsc --noEmit && vitest"}, ()),
])
def test_the_steps_before_an_npm_runner_run_lint_left_out(scripts: dict[str, str], setup: tuple[str, ...]) -> None:
    """What scripts.test does before its runner (a build, fixtures the tests read) still runs; lint does not."""
    found = npm_runner(scripts)
    assert found is not None and found.setup == setup


def test_npm_runners_reporting_on_stdout_or_through_kiln_reporters(tmp_path: Path) -> None:
    """ava's TAP goes to its report file, the rest of the output to the printed log; uvu and jasmine get kiln's
    reporter installed with the dependencies; a variable the script sets comes before c8; tap >= 18 renamed its
    options."""
    ava = plan(checkout(tmp_path / "a", {"package.json": '{"scripts": {"test": "NODE_ENV=test ava"}}'}))
    assert f"NODE_ENV=test /opt/c8/bin/c8 --reporter=json --report-dir={REPORTS_DIR}" in ava.test_script
    assert f" ava --tap 2>&1 >{REPORTS_DIR}/ava.tap | tee {REPORTS_DIR}/test-output.txt" in ava.test_script
    uvu = plan(checkout(tmp_path / "u", {"package.json": '{"scripts": {"test": "uvu tests"}}'}))
    assert "__kilnUvu" in uvu.deps_script and f"KILN_UVU_REPORT={REPORTS_DIR}/uvu.tap /opt/c8" in uvu.test_script
    assert "__kilnUvu" not in ava.deps_script
    tap = plan(checkout(tmp_path / "t", {"package.json": '{"scripts": {"test": "tap"}, "devDependencies": '
                                                         '{"tap": "^18.6.1"}}'}))
    assert f"tap --reporter=tap --disable-coverage 2>&1 >{REPORTS_DIR}/tap.tap" in tap.test_script


def test_npm_plan_runs_the_runner_with_its_reporter(tmp_path: Path) -> None:
    pkg = '{"name": "x", "scripts": {"test": "eslint . && mocha"}, "devDependencies": {"mocha": "10"}}'
    p = plan(checkout(tmp_path, {"package.json": pkg}))
    assert "export PATH=$PWD/node_modules/.bin:$PATH; /opt/c8/bin/c8" in p.test_script
    assert " _mocha --reporter xunit" in p.test_script and "eslint" not in p.test_script
    assert next(d for d in p.decisions if d.topic == "test command").choice == "mocha"


@pytest.mark.parametrize(("files", "command"), [
    ({"tox.ini": "[tox]\nenvlist = py311\n[testenv]\ndeps = pytest\ncommands =\n    python -m pytest -q "
                 "{posargs:tests/unit}\n"}, "pytest -q tests/unit"),
    # Pallets' testenv: the option whose value is tox's substitution goes with it (an empty --basetemp is the cwd).
    ({"tox.ini": "[testenv]\ncommands = pytest -v --tb=short --basetemp={envtmpdir} {posargs}\n"},
     "pytest -v --tb=short"),
    ({"tox.ini": "[testenv]\ncommands = pytest --basetemp {envtmpdir} -x {posargs}\n"}, "pytest -x"),
    # A command continued over lines (tox joins them), among several commands.
    ({"tox.ini": "[testenv]\ncommands =\n    {envpython} -m pip list\n    {envpython} -m pytest \\\n"
                 "        -q --tb=short \\\n        tests {posargs}\n    coverage report\n"},
     "pytest -q --tb=short tests"),
    ({"pyproject.toml": PYPROJECT + '[tool.tox]\nlegacy_tox_ini = """\n[testenv]\n'
                                    'commands = pytest -x {posargs}\n"""\n'}, "pytest -x"),
    ({"noxfile.py": "import nox\n@nox.session\ndef tests(session):\n    session.install('.')\n"
                    "    session.run('pytest', 'tests', '-q', *session.posargs)\n"}, "pytest tests -q"),
    # The test environment in a section of its own, after a docs one; several commands, the pytest one taken.
    ({"tox.ini": "[tox]\nenvlist = docs,tests\n[testenv:docs]\ncommands = sphinx-build docs out\n"
                 "[testenv:tests]\ncommands =\n    python -m pip check\n    pytest -x {posargs:tests}\n"},
     "pytest -x tests"),
    # tox 4's TOML (tox.toml, and pyproject's native [tool.tox]): each command a list of arguments.
    ({"tox.toml": 'env_list = ["3.11"]\n[env_run_base]\ncommands = [["pytest", "-q", "{posargs}"]]\n'},
     "pytest -q"),
    ({"pyproject.toml": PYPROJECT + '[tool.tox.env.lint]\ncommands = [["ruff", "check"]]\n'
                                    '[tool.tox.env.test]\ncommands = [["python", "-m", "pytest", "tests/unit"]]\n'},
     "pytest tests/unit"),
    # nox: coverage's pytest, keyword arguments no words of the command.
    ({"noxfile.py": "import nox\n@nox.session\ndef tests(session):\n    session.run('coverage', 'run', '-m', "
                    "'pytest', '-q', 'tests', env={'X': '1'})\n"}, "pytest -q tests"),
])
def test_ci_calling_tox_or_nox_runs_the_pytest_line_of_their_config(tmp_path: Path, files: dict[str, str],
                                                                    command: str) -> None:
    ci = ("jobs:\n  bench:\n    steps:\n      - run: pytest benchmarks --benchmark-only\n"
          "  test:\n    steps:\n      - run: pip install tox nox\n      - run: tox -e py\n      - run: nox\n")
    p = plan(checkout(tmp_path / "ci", {"pyproject.toml": PYPROJECT, **files, ".github/workflows/ci.yml": ci}))
    decision = next(d for d in p.decisions if d.topic == "test command")
    assert decision.choice == command and "ci.yml:test" in decision.reason, decision
    # A release artefact ships tox.ini or noxfile.py without its CI: they still say what runs the tests.
    bare = plan(checkout(tmp_path / "sdist", {"pyproject.toml": PYPROJECT, **files}))
    decision = next(d for d in bare.decisions if d.topic == "test command")
    assert decision.choice == command and decision.reason.startswith("no CI test job; "), decision


def test_requirement_files_bring_the_files_they_name(tmp_path: Path) -> None:
    """pip reads a requirement file's ``-r``/``-c`` references from the dependency layer: they are manifests too,
    even one (docs) that is no test requirement of its own."""
    p = plan(checkout(tmp_path, {"pyproject.toml": PYPROJECT, "requirements/dev.txt": "-r docs.txt\n-c ../pins.txt\n",
                                 "requirements/docs.txt": "sphinx\n", "pins.txt": "sphinx==7\n"}))
    assert "-r requirements/dev.txt" in p.deps_script and "docs.txt" not in p.deps_script.replace("dev.txt", "")
    assert {"requirements/dev.txt", "requirements/docs.txt", "pins.txt"} <= set(p.manifests)


def test_a_configure_naming_inputs_the_sources_lack_is_generated_again(tmp_path: Path) -> None:
    """A Debian dfsg repack drops a directory and patches configure.ac; the shipped configure still names it."""
    configure = 'ac_config_files="$ac_config_files Makefile doc/Makefile gmp.h:gmp-h.in"\n'
    files = {"configure": configure, "configure.ac": "AC_INIT\n", "Makefile.in": "", "gmp-h.in": ""}
    p = plan(checkout(tmp_path / "a", files))
    assert p.build_script.startswith("autoreconf -fi && ")
    assert "doc/Makefile.in" in next(d for d in p.decisions if d.topic == "configure").reason
    fresh = plan(checkout(tmp_path / "b", {**files, "doc/Makefile.in": ""}))
    assert fresh.build_script.startswith("{ [ -f configure ] || autoreconf -fi; }")


def test_a_project_wrapping_symbols_at_link_time_is_built_without_coverage(tmp_path: Path) -> None:
    """gcov's runtime calls open/close itself: a test program linked with ``-Wl,--wrap,open`` does not link with
    --coverage (real: libxcrypt 4.4.33, whose make check stopped at that link before any test)."""
    autotools = {"configure.ac": "AC_INIT\n", "Makefile.am": "SUBDIRS = test\n", "configure": "",
                 "test/Makefile.am": "t_LDFLAGS = -Wl,--wrap,getrandom -Wl,--wrap,open\n"}
    p = plan(checkout(tmp_path / "a", autotools))
    assert p.system == "autotools" and p.env == {}
    assert "test/Makefile.am links with '-Wl,--wrap,getrandom'" in next(
        d.reason for d in p.decisions if d.topic == "coverage")
    plain = plan(checkout(tmp_path / "b", {**autotools, "test/Makefile.am": "t_LDFLAGS = -Wl,-z,now\n"}))
    assert plain.env["LDFLAGS"] == "--coverage" and not any(d.topic == "coverage" for d in plain.decisions)


def test_jvm_rules_take_their_toolchain_as_a_layer_and_gradle_beyond_debians_is_unavailable(tmp_path: Path) -> None:
    pom = "<project><modelVersion>4.0.0</modelVersion><groupId>x</groupId><artifactId>calc</artifactId>" \
          "<version>1</version>{}</project>"
    single = plan(checkout(tmp_path / "m", {"pom.xml": pom.format("")}))
    assert (single.system, single.packages, single.manifests) == ("maven", ["openjdk-17-jdk-headless", "maven"],
                                                                  ["pom.xml"])
    assert "<mirrorOf>*</mirrorOf>" in single.deps_script and "go-offline ||" not in single.deps_script
    assert " -o -fae " in single.test_script and "surefire" in single.test_script
    # Modules (comments are no modules): every pom keys the dependency layer; go-offline may leave the others.
    multi = plan(checkout(tmp_path / "mm", {"pom.xml": pom.format("<modules><module>core</module><!-- <module>old"
                                                                  "</module> --><module>app</module></modules>"),
                                            "core/pom.xml": pom.format(""), "app/pom.xml": pom.format("")}))
    assert multi.manifests == ["pom.xml", "core/pom.xml", "app/pom.xml"] and "go-offline ||" in multi.deps_script
    gradle = plan(checkout(tmp_path / "g", {"build.gradle": "apply plugin: 'java'\n"}))
    assert gradle.system == "gradle" and "gradle" in gradle.packages
    assert gradle.env["GRADLE_USER_HOME"] == "/opt/gradle"
    for files, needs in (({"build.gradle": "", "gradle/wrapper/gradle-wrapper.properties":
                           "distributionUrl=https\\://services.gradle.org/distributions/gradle-8.5-bin.zip\n"}, "8.5"),
                         ({"build.gradle.kts": "plugins { java }\n"}, "5.0"),
                         ({"build.gradle": "test { useJUnitPlatform() }\n"}, "4.6")):
        with pytest.raises(ToolchainUnavailable, match=f"needs Gradle {needs}"):
            plan(checkout(tmp_path / f"g{needs}", files))
    old = plan(checkout(tmp_path / "g44", {"build.gradle": "", "gradle/wrapper/gradle-wrapper.properties":
                                           "distributionUrl=https\\://x/gradle-4.4-all.zip\n"}))
    assert old.system == "gradle"
    meson = plan(checkout(tmp_path / "ms", {"meson.build": "project('calc', 'c')\n"}))
    assert meson.system == "meson" and meson.packages == ["meson", "ninja-build"]
    assert "meson-testlog.json" in meson.test_script
    # A newer Go or a Python the toolchain lacks is the same class of failure.
    with pytest.raises(ToolchainUnavailable):
        plan(checkout(tmp_path / "go", {"go.mod": "module m\n\ngo 9.1\n"}))


@pytest.mark.parametrize(("files", "command", "build"), [
    # CI's test job runs the subdirectory's suite; the docs job's make comes after it in the file.
    ({"src/calc.c": "", "docs/Makefile": "html:\n\tsphinx-build . _build\n", "tests/Makefile": "all:\n\t./run\n",
      ".github/workflows/ci.yml": "jobs:\n  docs:\n    steps:\n      - run: make -C docs html\n  test:\n    steps:\n"
                                  "      - run: make -C tests\n"}, "make -C tests", "true"),
    ({"Makefile": "all:\n\tcc -c calc.c\n", "test/Makefile": "check:\n\t./t\n",
      ".travis.yml": "script:\n  - make\n  - cd test && make check\n"}, "make -C test check", "make"),
    # No CI: the conventional directory, its test target (else its default one).
    ({"t/Makefile": "all:\n\tcc t.c\ntest: all\n\t./a.out\n", "docs/Makefile": "html:\n\ttrue\n"}, "make -C t test",
     "true"),
])
def test_a_suite_in_a_subdirectory_is_run_where_it_is(tmp_path: Path, files: dict[str, str], command: str,
                                                      build: str) -> None:
    p = plan(checkout(tmp_path, files))
    assert p.system == "make" and p.build_script == build
    assert next(d for d in p.decisions if d.topic == "test command").choice == command
    assert p.test_script.startswith(f"{command} 2>&1 | tee {REPORTS_DIR}/make-check.txt")


def test_tests_cmakelists_beside_docs_is_the_project(tmp_path: Path) -> None:
    p = plan(checkout(tmp_path, {"docs/Makefile": "html:\n\ttrue\n", "tests/CMakeLists.txt": "project(t C)\n"}))
    assert p.system == "cmake" and p.build_script.startswith("cd tests && cmake")
    assert "conventional test directory" in p.decisions[0].reason


CI_DOCS_FIRST = """jobs:
  docs:
    steps:
      - run: pip install sphinx
      - run: make -C docs html
  release:
    steps:
      - run: make dist
  test:
    steps:
      - run: ./configure
      - run: make -C tests check
"""


def test_the_agent_tries_ci_test_jobs_first_and_each_candidate_until_one_itemises(tmp_path: Path) -> None:
    """CI's docs job comes first in the file and fails; the test job is tried first anyway, and a test command
    that exits 0 printing nothing kiln can itemise gives way to the next candidate."""
    root = checkout(tmp_path, {".github/workflows/ci.yml": CI_DOCS_FIRST,
                               "README.md": "# x\n\n```sh\nmake\n./run-tests\n```\n"})
    plan_ = classify(root)
    assert [c.source for c in plan_.candidates] == ["CI job ci.yml:test", "README", "CI job ci.yml:docs",
                                                    "CI job ci.yml:release"]
    tried: list[str] = []

    def run(command: str) -> tuple[int, str]:
        tried.append(command)
        if command == "./configure":
            return 1, "configure: error: no C compiler\n"
        if command == "./run-tests":
            return 0, "PASS: adds\nPASS: subtracts\nTests passed: 2\n"
        return 0, "all good\n"

    built, test, decisions, _output = run_loop(plan_, run, root, 16)
    assert (built, test) == (True, "./run-tests") and tried == ["./configure", "make", "./run-tests"]
    assert "from README: its output gives per-test results" in decisions[-1].reason
    # Exit 0 without per-test results is no test command: every candidate tried, then the agent gives up.
    silent = run_loop(plan_, lambda c: (0, "done\n"), root, 16)
    assert silent[0] is False and "no test command gave per-test results" in silent[3]


def test_an_install_failing_on_one_missing_dev_dependency_retries_without_it(tmp_path: Path) -> None:
    pkg = ('{"name": "x", "scripts": {"test": "mocha"}, "devDependencies": {"mocha": "10", '
           '"kiln-gone-linter": "1.0.0"}}')
    root = checkout(tmp_path / "n", {"package.json": pkg, "test/a.js": "require('assert')\n"})
    gone = ("npm error code E404\nnpm error 404 Not Found - GET https://registry.npmjs.org/kiln-gone-linter - Not "
            "found\nnpm error 404  'kiln-gone-linter@1.0.0' is not in this registry.\n")
    fixed = repair("npm ci", gone, root)
    assert fixed is not None and 'delete p.devDependencies["kiln-gone-linter"]' in fixed
    assert fixed.endswith("npm install --no-audit --no-fund")
    # The test runner itself missing is not dropped: the tests need it.
    assert repair("npm ci", gone.replace("kiln-gone-linter", "mocha"), root) is None
    notarget = "npm error notarget No matching version found for kiln-gone-linter@1.0.0.\n"
    assert repair("npm install", notarget, root) is not None
    reqs = checkout(tmp_path / "p", {"requirements-dev.txt": "pytest\nkiln-gone-tool==0.1\n",
                                     "tests/test_a.py": "import pytest\n"})
    missing = "ERROR: No matching distribution found for kiln-gone-tool==0.1\n"
    pip = repair("pip install -r requirements-dev.txt", missing, reqs)
    assert pip == ("grep -viE '^kiln\\-gone\\-tool([^A-Za-z0-9_.-]|$)' requirements-dev.txt > "
                   "/tmp/kiln-requirements-dev.txt; pip install -r /tmp/kiln-requirements-dev.txt")
    write(reqs, "tests/test_b.py", "from kiln_gone_tool import x\n")
    assert repair("pip install -r requirements-dev.txt", missing, reqs) is None


def test_the_system_libraries_a_c_build_requires_are_debian_packages_of_a_layer(tmp_path: Path) -> None:
    """Required pkg-config modules, CMake packages and meson's programs become the bookworm packages that ship
    them; optional ones, names Debian lacks, the repository's own scripts and vendored subprojects do not."""
    meson = plan(checkout(tmp_path / "meson", {
        "meson.build": "project('x', 'c')\nglib = dependency('glib-2.0', version: '>= 2.56')\n"
                       "# dependency('libxml-2.0')\nz = dependency('zlib', required: get_option('zlib'))\n"
                       "t = dependency('threads')\ny = dependency(\n  'yaml-0.1',\n  required: true,\n)\n"
                       "gperf = find_program('gperf')\nfind_program('doxygen', required: false)\n"
                       "find_program('scripts/gen.py')\nsd = dependency('libsystemd', required: get_option('sd'))\n"
                       "x = dependency('x11', required: get_option('x'))\n"
                       "g = dependency('gtk4', required: get_option('g'))\nstem = cc.find_library('stemmer')\n",
        "meson_options.txt": "option('sd', type : 'boolean')\noption('x', type: 'boolean', value: false)\n"
                             "option('g', type: 'feature', value: 'auto')\n",
        "subprojects/v/meson.build": "dependency('libcurl')\n", "examples/meson.build": "dependency('sdl2')\n",
        ".pc/a.patch/meson.build": "dependency('libcurl')\n"}))
    assert meson.packages == ["meson", "ninja-build", "libglib2.0-dev", "libyaml-dev", "gperf", "libsystemd-dev",
                              "libstemmer-dev"]
    assert "glib-2.0 (pkg-config, meson.build): libglib2.0-dev" in next(
        d.reason for d in meson.decisions if d.topic == "system packages")
    cmake = plan(checkout(tmp_path / "cmake", {
        "CMakeLists.txt": "find_package(GTest REQUIRED)\nfind_package(ZLIB)\nfind_package(NotInDebian REQUIRED)\n"
                          "pkg_check_modules(DEPS REQUIRED IMPORTED_TARGET yaml-0.1>=0.2 libxml-2.0)\n"}))
    assert cmake.packages == ["libgtest-dev", "libyaml-dev", "libxml2-dev"]
    autotools = plan(checkout(tmp_path / "autotools", {
        "configure.ac": "AC_INIT([x], [1])\nPKG_CHECK_MODULES([GLIB], [glib-2.0 >= 2.40 gio-2.0])\n"
                        "PKG_CHECK_MODULES([YAML], [yaml-0.1], [have_yaml=yes], [have_yaml=no])\n"
                        "dnl PKG_CHECK_MODULES([X], [libxml-2.0])\n",
        "Makefile.am": "check_PROGRAMS = t\n"}))
    assert autotools.packages == ["libglib2.0-dev"]


def test_a_java_level_jdk17_no_longer_compiles_is_raised_in_the_image(tmp_path: Path) -> None:
    pom = ("<project><modelVersion>4.0.0</modelVersion><groupId>x</groupId><artifactId>x</artifactId>"
           "<version>1.5</version><properties><java.version>1.6</java.version></properties><build><plugins><plugin>"
           "<artifactId>maven-compiler-plugin</artifactId><configuration><source>1.5</source>"
           "<target>1.5</target></configuration></plugin></plugins></build></project>")
    p = plan(checkout(tmp_path, {"pom.xml": pom}))
    assert "<source>1.5</source>" in next(d.reason for d in p.decisions if d.topic == "java level")
    work = tmp_path / "work"
    checkout(work, {"pom.xml": pom})

    subprocess.run(p.build_script.split(" && ")[0], shell=True, cwd=work, check=True)
    raised = (work / "pom.xml").read_text()
    assert "<source>1.8</source><target>1.8</target>" in raised and "<java.version>1.8<" in raised
    assert "<version>1.5</version>" in raised  # the project's own version is no Java level
    assert not any(d.topic == "java level" and "1.5" in d.reason for d in plan(checkout(tmp_path / "new", {
        "pom.xml": pom.replace(">1.5</source>", ">11</source>").replace(">1.5</target>", ">11</target>").replace(
            ">1.6<", ">17<")})).decisions)


def test_an_npm_install_of_versions_the_registry_lacks_is_retried_with_each_range_widened_to_its_major(
        tmp_path: Path) -> None:
    pkg = ('{"name": "x", "scripts": {"test": "tape test/*.js"}, "dependencies": {"a": "~0.4.1", "b": "git+https://x"},'
           ' "devDependencies": {"tape": "^5.10.3", "eslint": "9"}}')
    root = checkout(tmp_path / "n", {"package.json": pkg, "test/a.js": "require('tape')\n"})
    deps = plan(root).deps_script
    assert deps.index("installing what the tests use") < deps.index("each version range widened to its major")
    widen = re.findall(r"node -e '([^']*)'", deps)[1]
    subprocess.run(["node", "-e", widen], cwd=root, check=True)
    assert json.loads((root / "package.json").read_text()) == {
        "name": "x", "scripts": {"test": "tape test/*.js"}, "dependencies": {"a": "^0", "b": "git+https://x"},
        "devDependencies": {"tape": "^5", "eslint": "9"}}


def test_the_system_headers_make_and_autotools_sources_include_are_debian_packages(tmp_path: Path) -> None:
    """Included outside any #if, provided by neither the repository (a generated x.h from x.h.in included) nor the
    toolchain image, and in a source for this platform."""
    root = checkout(tmp_path, {
        "Makefile": "test:\n\tcc -o t t.c -lyaml && ./t\n",
        "t.c": "#include <stdio.h>\n#include <yaml.h>\n#include \"local.h\"\n#include <own/x.h>\n"
               "#include <gen.h>\n#ifdef _WIN32\n#include <io.h>\n#endif\n#  include <alsa/asoundlib.h>\n",
        "local.h": "#ifndef LOCAL_H\n#define LOCAL_H\n#include <zlib.h>\n#if HAVE_FFI\n#include <ffi.h>\n#endif\n"
                   "#endif\n",
        "include/own/x.h": "", "gen.h.in": "", "pex-win32.c": "#include <libxml/parser.h>\n"})
    assert plan(root).packages == ["libyaml-dev", "libasound2-dev", "zlib1g-dev"]
