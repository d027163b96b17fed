"""Issue 50's drawing rule (``bench/corpus_draw.py``) on small inputs written here — no network: the split by
``sha256(ecosystem/name)``, the stop rule and resuming from the log, each skip reason, the citation order, and the
committed corpus agreeing with its draw log; and ``bench/builder.py --real``'s halves and results file."""

from __future__ import annotations

import csv
import hashlib
import shutil
from pathlib import Path

import pytest

from bench.builder import chosen_projects, real_metrics, results_file
from bench.corpus import Project, projects
from bench.corpus_draw import (
    LOG,
    Candidate,
    Fetch,
    cite,
    debian_list,
    draw_list,
    key,
    parse_sources,
    read_log,
    rust_list,
    upstream_version,
    write_manifest,
)
from kiln.workers.builder.rules import RULES_VERSION


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_split_is_the_first_hex_digit_of_sha256_of_ecosystem_and_name() -> None:
    for p in projects():
        digit = int(hashlib.sha256(f"{p.ecosystem}/{p.name}".encode()).hexdigest()[0], 16)
        if p.drawn == "issue 50 rule":
            assert p.half == ("reporting" if digit < 8 else "tuning"), p.name
            assert p.cite and ":" in p.cite and p.test, p.name
        else:  # the projects chosen before count in the tuning half whatever their hash
            assert p.drawn == "before issue 50" and p.half == "tuning", p.name


def test_the_committed_corpus_is_what_its_draw_log_keeps() -> None:
    rows = read_log(LOG)
    kept = {(r["ecosystem"], r["name"], r["version"], r["list"], r["test"], r["cite"]) for r in rows
            if r["outcome"] == "kept"}
    drawn = {(p.ecosystem, p.name, p.version, p.system, p.test, p.cite) for p in projects()
             if p.drawn == "issue 50 rule"}
    assert kept == drawn
    assert all(r["reason"] for r in rows if r["outcome"] == "skipped")
    for system in {r["list"] for r in rows}:  # a list stops at 16 kept, and looks at nothing after the 16th
        mine = sorted((r for r in rows if r["list"] == system), key=lambda r: int(r["position"]))
        assert sum(r["outcome"] == "kept" for r in mine) <= 16
        if sum(r["outcome"] == "kept" for r in mine) == 16:
            assert mine[-1]["outcome"] == "kept"


def _fetcher(sources: Path) -> Fetch:
    """Fetch a project from a folder of unpacked artefacts (a missing one is 'not served', as a registry's 404)."""
    def fetch(project: Project, into: Path, work: Path) -> None:
        source = sources / project.name
        if not source.is_dir():
            raise RuntimeError(f"{project.name}: HTTP Error 404: Not Found")
        shutil.copytree(source, into)
    return fetch


def test_a_list_is_drawn_in_order_skips_are_logged_and_it_stops_and_resumes(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    cmake = {"CMakeLists.txt": "project(x C)\nenable_testing()\nadd_test(NAME t COMMAND t)\n", "tests/t.c": ""}
    _tree(sources / "a-kept", cmake)
    _tree(sources / "b-no-tests", {"CMakeLists.txt": "project(x C)\n", "src/x.c": ""})
    _tree(sources / "c-autotools", {"configure.ac": "AC_INIT\n", "Makefile.am": "TESTS = t\n", "tests/t.sh": ""})
    _tree(sources / "d-uncited", {"CMakeLists.txt": "project(x C)\n", "tests/data.txt": ""})
    _tree(sources / "f-kept", cmake)
    _tree(sources / "g-kept", cmake)
    entries = [Candidate("cmake", 1, "debian", "a-kept", "1.0-1"),
               Candidate("cmake", 2, "debian", "b-no-tests", "1.0-1"),
               Candidate("cmake", 3, "debian", "c-autotools", "1.0-1"),
               Candidate("cmake", 4, "debian", "d-uncited", "1.0-1"),
               Candidate("cmake", 5, "debian", "e-not-served", "1.0-1"),
               Candidate("cmake", 6, "debian", "big", "1.0-1", size=65 << 20),
               Candidate("cmake", 7, "debian", "native", "0.2", native=True),
               Candidate("cmake", 8, "debian", "old", "1.0-1"),
               Candidate("cmake", 9, "debian", "f-kept", "1.0-1"),
               Candidate("cmake", 10, "debian", "g-kept", "1.0-1")]
    log = tmp_path / "draw-log.tsv"
    known = {("debian", "old")}
    fetch = _fetcher(sources)
    assert draw_list(entries, known, 2, log, fetch, 64 << 20, tmp_path) == 2
    rows = read_log(log)
    assert [(r["name"], r["outcome"], r["reason"]) for r in rows] == [
        ("a-kept", "kept", ""),
        ("b-no-tests", "skipped", "ships no tests"),
        ("c-autotools", "skipped", "top runs autotools, not cmake"),
        ("d-uncited", "skipped", "no test command can be cited"),
        ("e-not-served", "skipped", "not served or does not unpack: e-not-served: HTTP Error 404: Not Found"),
        ("big", "skipped", "over 64 MiB (65 MiB of upstream tarballs)"),
        ("native", "skipped", "a native Debian package: no upstream artefact"),
        ("old", "skipped", "already in the corpus"),
        ("f-kept", "kept", "")]  # the second kept: the list stops before g-kept
    assert rows[0]["test"] == "cmake -S . -B build && cmake --build build && ctest --test-dir build"
    assert rows[0]["cite"] == "CMakeLists.txt:2"
    # Interrupted and started again: nothing is judged twice; a higher stop goes on from the next entry.
    assert draw_list(entries, known, 2, log, fetch, 64 << 20, tmp_path) == 2 and len(read_log(log)) == 9
    assert draw_list(entries, known, 3, log, fetch, 64 << 20, tmp_path) == 3
    assert [r["name"] for r in read_log(log)][-1] == "g-kept" and len(read_log(log)) == 10
    manifest = tmp_path / "projects.toml"
    manifest.write_text("")
    assert write_manifest(manifest, log) == 3
    assert 'cite = "CMakeLists.txt:2"\ndrawn = "issue 50 rule"\n' in manifest.read_text()


@pytest.mark.parametrize(("system", "files", "test", "where"), [
    # The CI file first; a line that installs the runner is no test command, a templated one neither.
    ("python", {".github/workflows/ci.yml": "steps:\n  - run: pip install pytest pytest-cov\n"
                                            "  - run: pytest ${{ matrix.args }}\n  - run: python -m pytest -q tests\n",
                "tox.ini": "[testenv]\ncommands = pytest\n"},
     "python -m pytest -q tests", ".github/workflows/ci.yml:4"),
    # tox as tox runs it with no arguments: {envpython}, {posargs:default}, {toxinidir}, {/}, continued lines
    ("python", {"tox.ini": "[tox]\nenvlist = py\n[testenv]\ndeps = pytest\ncommands =\n"
                           "    {envpython} -m pytest \\\n      {posargs:{toxinidir}{/}tests}\n"},
     "python -m pytest ./tests", "tox.ini:7"),
    # A CI line that only names the runner, and a README sentence, are no commands.
    ("python", {".github/workflows/bot.yml": "    author: pytest bot <bot@example.org>\n",
                "README.rst": "Run pytest benchmarks with care.\nThen run ``pytest -q`` from the top.\n"},
     "pytest -q", "README.rst:2"),
    # A Makefile's test target, a pyproject script table; not a dependency list nor another tox environment.
    ("python", {"Makefile": "lint:\n\tpytest --lint\ntest:\n\tcoverage run -m pytest tests\n",
                "tox.ini": "[testenv:docs]\ncommands = pytest docs\n",
                "pyproject.toml": '[project.optional-dependencies]\ntest = [\n  "pytest>=8",\n]\n'},
     "pytest tests", "Makefile:4"),
    ("python", {"pyproject.toml": '[dependency-groups]\ndev = ["pytest>=8"]\n[tool.hatch.envs.test.scripts]\n'
                                  'test = "pytest {args:tests}"\n'}, "pytest tests", "pyproject.toml:4"),
    ("python", {"tox.ini": "[testenv]\ncommands = {env:COV:} pytest {posargs:{env:ARGS:}}\n"}, "pytest", "tox.ini:2"),
    ("python", {"noxfile.py": "def tests(session):\n    session.run('pytest', 'tests', '-q')\n"},
     "pytest tests -q", "noxfile.py:2"),
    ("python", {"README.md": "Run the suite:\n\n    $ pytest tests\n"}, "pytest tests", "README.md:3"),
    ("npm", {"package.json": '{\n  "scripts": {\n    "test": "tape test/*.js"\n  }\n}\n'},
     "npm test", "package.json:3"),
    ("cargo", {"Cargo.toml": "[package]\nname = 'x'\n"}, "cargo test", "Cargo.toml:1"),
    ("go", {"go.mod": "module example.com/x\n", "Makefile": "test:\n\tgo test -race ./...\n"},
     "go test -race ./...", "Makefile:2"),
    ("maven", {".travis.yml": "install: mvn -B test-compile dependency:go-offline\nscript: ./mvnw -B verify\n",
               "pom.xml": "<project>\n"}, "mvn -B verify", ".travis.yml:2"),
    ("gradle", {".github/workflows/b.yml": "- uses: gradle/gradle-build-action@v2\n",
                "build.gradle": "plugins {\n    id 'java'\n}\n"}, "gradle test", "build.gradle:2"),
    ("meson", {"meson.build": "project('x', 'c')\nexe = executable('t', 't.c')\ntest('t', exe)\n"},
     "meson setup build && meson test -C build", "meson.build:3"),
    ("autotools", {"configure.ac": "AC_INIT\n", "tests/Makefile.am": "check_PROGRAMS = t\nTESTS = t\n"},
     "autoreconf -fi && ./configure && make && make check", "tests/Makefile.am:1"),
    ("make", {"Makefile": "all:\n\tcc -o x x.c\ntest: all\n\t./x --selftest\n"}, "make && make test", "Makefile:3"),
])
def test_the_test_command_is_cited_in_the_rule_s_order(tmp_path: Path, system: str, files: dict[str, str],
                                                       test: str, where: str) -> None:
    found = cite(_tree(tmp_path, files), system)
    assert found is not None and (found.test, found.cite) == (test, where)


def test_no_citation_where_nothing_runs_tests(tmp_path: Path) -> None:
    assert cite(_tree(tmp_path / "npm", {"package.json": '{"scripts": {\n"test": "echo \\"Error: no test '
                                                         'specified\\" && exit 1"\n}}\n'}), "npm") is None
    assert cite(_tree(tmp_path / "cmake", {"CMakeLists.txt": "project(x)\nadd_executable(x x.c)\n"}), "cmake") is None


SOURCES = """Package: zeta
Version: 1.0-1
Build-Depends: debhelper-compat (= 13), cmake
Checksums-Sha256:
 {h} 10 zeta_1.0-1.dsc
 {h} 2048 zeta_1.0.orig.tar.gz

Package: alpha
Version: 2:3.1+dfsg-2
Build-Depends: debhelper-compat (= 13), meson | cmake,
 pkg-config
Checksums-Sha256:
 {h} 1000 alpha_3.1+dfsg.orig.tar.xz
 {h} 24 alpha_3.1+dfsg.orig-docs.tar.xz

Package: helper
Version: 0.2
Build-Depends-Indep: cmake
Checksums-Sha256:
 {h} 900 helper_0.2.tar.xz

Package: plain
Version: 1.0-1
Build-Depends: debhelper-compat (= 13)

Package: rust-rand-core-0.5
Version: 0.5.1-1

Package: rust-foo
Version: 0.0~git20200101.abcdef-1
""".replace("{h}", "0" * 64)


def test_debian_lists_are_the_build_dependents_in_alphabetical_order() -> None:
    sources = parse_sources(SOURCES)
    cmake = debian_list("cmake", sources)
    assert [(c.name, c.position, c.size, c.native) for c in cmake] == [
        ("alpha", 1, 1024, False), ("helper", 2, 0, True), ("zeta", 3, 2048, False)]
    assert [c.name for c in debian_list("meson", sources)] == ["alpha"]
    assert "plain" in [c.name for c in debian_list("make", sources)]
    crates = rust_list(sources)
    assert [(c.name, c.version, c.skip) for c in crates] == [
        ("foo", "0.0~git20200101.abcdef-1", "Debian 0.0~git20200101.abcdef-1 names a git snapshot, no release"),
        ("rand-core", "0.5.1", "")]


def test_rule_4_compares_pypi_names_as_pypi_normalises_them() -> None:
    assert key("pypi", "Jinja2") == key("pypi", "jinja2") == key("pypi", "JINJA2")
    assert key("pypi", "typing_extensions") == key("pypi", "typing-extensions")
    assert key("npm", "JSONStream") != key("npm", "jsonstream")


def test_upstream_versions() -> None:
    assert upstream_version("2:3.1+dfsg-2") == "3.1"
    assert upstream_version("1.0.0~rc1-3") == "1.0.0-rc1"
    assert upstream_version("1.2.3+ds1-1+deb12u1") == "1.2.3"
    assert upstream_version("0.0~git20200101.abcdef-1") is None


def test_the_real_bench_selects_a_half_and_records_per_rules_version_and_half(tmp_path: Path) -> None:
    assert results_file("reporting", tmp_path) == tmp_path / f"rules-{RULES_VERSION}-reporting.jsonl"
    assert results_file(None, tmp_path).name == f"rules-{RULES_VERSION}-all.jsonl"
    reporting = chosen_projects([], "reporting")
    assert reporting and all(p.half == "reporting" and p.drawn == "issue 50 rule" for p in reporting)
    assert len(reporting) + len(chosen_projects([], "tuning")) == len(projects())
    records = [{"slug": "a", "system": "cmake", "half": "reporting", "outcome": "usable", "usable": True,
                "by_agent": False},
               {"slug": "b", "system": "cmake", "half": "reporting", "outcome": "compile_failed", "usable": False,
                "by_agent": False},
               {"slug": "c", "system": "go", "half": "tuning", "outcome": "usable", "usable": True,
                "by_agent": False}]
    metrics = real_metrics(records)
    assert metrics["build_success_rate_real_reporting"] == 0.5
    assert metrics["build_success_rate_real_reporting_cmake"] == 0.5
    assert metrics["build_failures_reporting_cmake_compile_failed"] == 1.0
    assert metrics["build_success_rate_real_tuning"] == 1.0 and metrics["build_success_rate_real"] == 0.667


def test_the_log_is_a_tab_separated_table_with_its_header() -> None:
    with LOG.open(newline="") as handle:
        header = next(csv.reader(handle, delimiter="\t"))
    assert header == ["list", "position", "ecosystem", "name", "version", "outcome", "reason", "test", "cite"]
