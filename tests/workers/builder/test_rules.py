"""The rules on the failure classes real repositories showed (issue 18), decided from files alone: which CI job
is the test suite, a Dockerfile that cannot be used, test dependencies, versions from VCS metadata, npm lifecycle
scripts, and what the agent may take from a README or CI file."""

from __future__ import annotations

from pathlib import Path

from kiln.workers.builder.agent import AgentPlan, classify, run_loop
from kiln.workers.builder.rules import describe, plan, readme_commands
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

    built, test, _decisions, _output = run_loop(AgentPlan(test=[f"t{i}" for i in range(8)]), run, tmp_path, 20)
    assert not built and test is None and tried == ["t0", "t1", "t2"]


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
