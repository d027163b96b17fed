"""Draw issue 50's corpus by the rule written in the header of ``bench/corpus/projects.toml`` (its ``[draw]`` table):
the lists in their order, each entry fetched with its ecosystem's client (``bench.corpus.fetch_sources``), kept only
when it ships tests, its test command can be cited (file:line) and its top-level build file is the list's system;
every entry looked at is a line of ``bench/corpus/draw-log.tsv`` (kept, or skipped and why). A list stops at
``stop_at`` kept projects or when exhausted. The log is the state: an interrupted draw goes on where it stopped.

Usage: python -m bench.corpus_draw [--lists python npm ...]   (draws, appending to the log)
       python -m bench.corpus_draw --write                   (appends the kept projects to projects.toml)
       python -m bench.corpus_draw --counts                  (kept projects per system and half)
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import tempfile
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from bench.corpus import CACHE, MANIFEST, Project, apt_dir, carries_tests, fetch_sources, half_of, projects

LOG = MANIFEST.parent / "draw-log.tsv"
PACKAGES = Path("/work/.library/env/packages")
COLUMNS = ("list", "position", "ecosystem", "name", "version", "outcome", "reason", "test", "cite")
DRAWN = "issue 50 rule"

# The Debian packages a source's Build-Depends names for each system (make: none of them).
BUILD_DEPENDS = {"maven": {"maven-debian-helper", "maven"}, "gradle": {"gradle-debian-helper", "gradle"},
                 "meson": {"meson"}, "cmake": {"cmake"}, "autotools": {"dh-autoreconf", "autoconf"}}
# The top-level build file each system runs from (rule 5), in the order a source's system is told.
TOP_FILES = {"maven": ("pom.xml",), "gradle": ("build.gradle", "build.gradle.kts", "settings.gradle",
                                               "settings.gradle.kts"),
             "meson": ("meson.build",), "cmake": ("CMakeLists.txt",),
             "autotools": ("configure.ac", "configure.in", "configure"),
             "make": ("Makefile", "makefile", "GNUmakefile"),
             "python": ("pyproject.toml", "setup.py"), "npm": ("package.json",), "cargo": ("Cargo.toml",),
             "go": ("go.mod",)}
# CI files of Linux runners (AppVeyor's are Windows: its commands do not run in kiln's image).
CI_FILES = (".github/workflows/*.yml", ".github/workflows/*.yaml", ".gitlab-ci.yml", ".travis.yml",
            ".circleci/config.yml", "azure-pipelines.yml", ".cirrus.yml")
_ARGS = r"[^'\"`\n]*"
_END = r"(?![\w-])"
STEPS = {  # the test step a cited command starts with, per system
    "python": re.compile(rf"(?:python[\d.]* -m )?pytest{_END}(?!\s*[<>=!~;\[]){_ARGS}"),  # not a requirement
    "npm": re.compile(r"npm (?:run )?test[\w:-]*"),
    "cargo": re.compile(rf"cargo test{_END}{_ARGS}"),
    "go": re.compile(rf"go test{_END}{_ARGS}"),
    "maven": re.compile(rf"(?:mvn|\./mvnw) {_ARGS}\b(?:test|verify|install|package){_END}{_ARGS}"),
    "gradle": re.compile(rf"(?:gradle|\./gradlew) {_ARGS}\b(?:test|check|build){_END}{_ARGS}"),
    "cmake": re.compile(rf"ctest{_END}{_ARGS}"),
    "meson": re.compile(rf"meson test{_END}{_ARGS}"),
    "autotools": re.compile(rf"make (?:-\S+ )*(check|test){_END}"),
    "make": re.compile(rf"make (?:-\S+ )*(check|tests?){_END}"),
}
# What stands before a command on its line: a YAML list item or key, a block scalar, a quote, a prompt, make's @.
_LEAD = re.compile(r"""^(?:-\s+)?(?:(?:run|script|command|cmd|test|test_script)\s*:\s+)?[|>]?\s*["']?(?:\$\s+)?@?""")
# Wrappers that run the command after them (dropped: the step is what runs the tests).
_WRAPPERS = re.compile(r"^(?:(?:sudo|time|env|xvfb-run(?: -a)?|poetry run|uv run|pipenv run|pdm run|hatch run|"
                       r"coverage run -m|[A-Z_][A-Z0-9_]*=\S*)\s+)*")
# CI workflows that do not test the project itself come last (downstream projects, releases, docs).
_LATE = re.compile(r"downstream|release|publish|deploy|docs?\b|pages|bench|update|nightly", re.IGNORECASE)

BUILD_FILE_TESTS = {  # the build file's own test target: (file globs, line pattern), per system
    "cargo": (("Cargo.toml",), re.compile(r"^\[package\]")),
    "go": (("Makefile", "go.mod"), re.compile(r"^\s+.*\bgo test\b|^module ")),
    "maven": (("pom.xml",), re.compile(r"<project\b")),
    "gradle": (("build.gradle", "build.gradle.kts", "*/build.gradle", "*/build.gradle.kts"),
               re.compile(r"""(?:apply plugin:|\bid)\s*\(?\s*['"](?:java|java-library|groovy|application|"""
                          r"""org\.jetbrains\.kotlin\.jvm)['"]|\bkotlin\(\s*"jvm"\s*\)|^\s*test\s*\{""")),
    "cmake": (("CMakeLists.txt", "**/CMakeLists.txt"),
              re.compile(r"^\s*(?:add_test|gtest_discover_tests|enable_testing|include\s*\(\s*CTest)\b",
                         re.IGNORECASE)),
    "meson": (("meson.build", "**/meson.build"), re.compile(r"^\s*test\s*\(")),
    "autotools": (("Makefile.am", "**/Makefile.am"),
                  re.compile(r"^\s*(?:TESTS|check_PROGRAMS|check_SCRIPTS)\s*\+?=|^(?:check-local|check)\s*:")),
    "make": (("Makefile", "makefile", "GNUmakefile"), re.compile(r"^(check|tests?)\s*::?(?!=)")),
}
SEQUENCES = {  # systems whose tests run in a build tree: the command is the configure-build-test sequence
    "cmake": "cmake -S . -B build && cmake --build build && ctest --test-dir build",
    "meson": "meson setup build && meson test -C build",
}


@dataclass(frozen=True)
class Candidate:
    list: str
    position: int
    ecosystem: str
    name: str
    version: str
    size: int = 0  # bytes of the upstream tarballs the Debian index lists (0: not known)
    native: bool = False  # a Debian source with no upstream tarball
    skip: str = ""  # why the list entry names no release (a git snapshot)

    def project(self, test: str = "", cite: str = "") -> Project:
        return Project(self.ecosystem, self.name, self.version, self.list, test, DRAWN, cite,
                       half_of(self.ecosystem, self.name))


@dataclass(frozen=True)
class Citation:
    test: str
    cite: str  # file:line


# --- the lists ---------------------------------------------------------------------------------------------------

def _tsv(path: Path) -> Iterator[dict[str, str]]:
    with path.open(newline="") as handle:
        yield from csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)


def pypi_list(path: Path = PACKAGES / "pypi.tsv") -> list[Candidate]:
    rows = [r for r in _tsv(path) if (r.get("rank_among_15000_most_downloaded") or "").isdigit()]
    rows.sort(key=lambda r: int(r["rank_among_15000_most_downloaded"]))
    return [Candidate("python", i, "pypi", r["name"], r["version"]) for i, r in enumerate(rows, 1)]


def npm_list(path: Path = PACKAGES / "npm.tsv") -> list[Candidate]:
    rows = [r for r in _tsv(path) if (r.get("downloads_a_month") or "").isdigit()]
    rows.sort(key=lambda r: -int(r["downloads_a_month"]))
    return [Candidate("npm", i, "npm", r["name"], r["version"]) for i, r in enumerate(rows, 1)]


def _field(stanza: str, name: str) -> str:
    found = re.search(rf"^{name}:[ \t]*(.*(?:\n[ \t].*)*)", stanza, re.MULTILINE)
    return found.group(1) if found else ""


def parse_sources(text: str) -> dict[str, str]:
    """Debian's source index (bookworm main, as ``apt-get update`` fetched it): one stanza per source package."""
    stanzas = {}
    for stanza in text.split("\n\n"):
        name = _field(stanza, "Package")
        if name:
            stanzas[name] = stanza
    return stanzas


def debian_sources(work: Path = CACHE / "downloads") -> dict[str, str]:
    lists = Path(apt_dir(work)[-1].split("=", 1)[1])
    index = next(lists.glob("*_debian_dists_bookworm_main_source_Sources*"))
    text = subprocess.run(["/usr/lib/apt/apt-helper", "cat-file", str(index)], capture_output=True, text=True,
                          check=True).stdout
    return parse_sources(text)


def _build_depends(stanza: str) -> set[str]:
    text = ",".join(_field(stanza, f) for f in ("Build-Depends", "Build-Depends-Indep", "Build-Depends-Arch"))
    return {re.split(r"[\s(:\[<]", alt.strip())[0] for dep in text.replace("\n", " ").split(",")
            for alt in dep.split("|") if alt.strip()}


def _upstream_tarballs(stanza: str) -> list[int]:
    return [int(size) for size in re.findall(r"^ [0-9a-f]{64} (\d+) \S+\.orig(?:-[\w.-]+)?\.tar\.\w+$",
                                             _field(stanza, "Checksums-Sha256"), re.MULTILINE)]


def debian_list(system: str, sources: dict[str, str]) -> list[Candidate]:
    every = set().union(*BUILD_DEPENDS.values())
    names = sorted(n for n, s in sources.items()
                   if (_build_depends(s) & BUILD_DEPENDS[system] if system in BUILD_DEPENDS
                       else not _build_depends(s) & every))
    out = []
    for i, name in enumerate(names, 1):
        sizes = _upstream_tarballs(sources[name])
        out.append(Candidate(system, i, "debian", name, _field(sources[name], "Version"), sum(sizes), not sizes))
    return out


def upstream_version(debian: str) -> str | None:
    """The release a Debian version names (epoch and revision dropped, repack suffixes dropped, ``~`` as ``-``);
    None for a git (or other VCS) snapshot."""
    version = re.sub(r"^\d+:", "", debian)
    version = version.rsplit("-", 1)[0] if "-" in version else version
    if re.search(r"git|bzr|svn|hg\d|cvs", version):
        return None
    return re.sub(r"[+~](?:dfsg|ds|repack)\d*.*$", "", version).replace("~", "-")


def rust_list(sources: dict[str, str]) -> list[Candidate]:
    out = []
    for i, package in enumerate(sorted(n for n in sources if n.startswith("rust-")), 1):
        debian = _field(sources[package], "Version")
        version = upstream_version(debian)
        name = package.removeprefix("rust-")
        suffix = re.match(r"(.+)-(\d+(?:\.\d+)*)$", name)
        if suffix and version and version.startswith(suffix.group(2)):
            name = suffix.group(1)
        out.append(Candidate("cargo", i, "crates", name, version or debian,
                             skip="" if version else f"Debian {debian} names a git snapshot, no release"))
    return out


def go_list(sources: dict[str, str]) -> list[Candidate]:
    out = []
    for i, package in enumerate(sorted(n for n in sources if n.startswith("golang-")), 1):
        path, debian = _field(sources[package], "Go-Import-Path").split(",")[0].strip(), _field(
            sources[package], "Version")
        version = upstream_version(debian)
        skip = ("no Go-Import-Path in the index" if not path else
                "" if version else f"Debian {debian} names a git snapshot, no release")
        out.append(Candidate("go", i, "go", path or package, f"v{version}" if version else debian, skip=skip))
    return out


def candidates(system: str, sources: Callable[[], dict[str, str]]) -> list[Candidate]:
    if system == "python":
        return pypi_list()
    if system == "npm":
        return npm_list()
    if system == "cargo":
        return rust_list(sources())
    if system == "go":
        return go_list(sources())
    return debian_list(system, sources())


# --- rule 3: the citation ----------------------------------------------------------------------------------------

def _lines(root: Path, patterns: Iterable[str]) -> Iterator[tuple[str, int, str]]:
    seen: set[Path] = set()
    for pattern in patterns:
        for path in sorted(root.glob(pattern), key=lambda p: (bool(_LATE.search(p.name)), len(p.parts), str(p))):
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                yield str(path.relative_to(root)), number, line


def _step(system: str, line: str) -> str | None:
    """The test step a line runs as a command (at its start, after ``&&``/``;``, or in backquotes), cut at a
    following command; None where it runs none, or only a templated one."""
    for segment in [*re.split(r"\s*(?:&&|\|\||;|\bthen\b|\bdo\b)\s*", line), *re.findall(r"`([^`]+)`", line)]:
        found = STEPS[system].match(_WRAPPERS.sub("", _LEAD.sub("", segment.strip())))
        if found is None:
            continue
        step = re.split(r"\s+[|#]\s*", found.group(0))[0].strip().rstrip("\\").strip()
        if re.search(r"\$|\{|%\w+%|skipTests|=$", step):
            continue
        return re.sub(r"^\./mvnw\b", "mvn", re.sub(r"^\./gradlew\b", "gradle", step))
    return None


def _command(system: str, step: str, root: Path) -> str:
    """The command written down for a cited step: the step itself, or the system's configure-build-test sequence."""
    if system in SEQUENCES:
        return SEQUENCES[system]
    if system in ("autotools", "make"):
        target = step.split()[-1] if step.startswith("make") else step
        if system == "make":
            return f"make && make {target}"
        configure = "./configure" if (root / "configure").is_file() else "autoreconf -fi && ./configure"
        return f"{configure} && make && make {target}"
    if system == "npm":
        return "npm test" if step in ("npm test", "npm run test") else step
    return step


def _substituted(text: str) -> str:
    """tox's and hatch's substitutions as a run without arguments makes them."""
    text = text.replace("{envpython}", "python").replace("{toxinidir}", ".").replace("{/}", "/")
    text = re.sub(r"\{env:[^:}]*:([^{}]*)\}", r"\1", text)
    return re.sub(r"\{(?:posargs|args)(?::([^}]*))?\}", lambda m: m.group(1) or "", text).strip()


_TEST_ENV = re.compile(r"^\[testenv(?::(?:py[\w.-]*|tests?|unit\w*))?\]")
_TEST_TARGET = re.compile(r"^(?:tests?|check|unit|unittests?)\s*:(?!=)")


def _python(root: Path) -> Citation | None:
    """The commands of tox.ini's test environment (``[testenv]``, ``[testenv:py*]``, ``[testenv:test]``;
    continued lines joined), a noxfile's ``session.run``, the build files' test scripts (a Makefile's test target,
    pyproject.toml's script tables), in that order."""
    section, in_commands, held = "", False, ""
    for file, number, line in _lines(root, ("tox.ini",)):
        if line.startswith("["):
            section, in_commands = line.strip(), False
            continue
        if re.match(r"^\s*commands\s*=", line):
            in_commands, line = True, line.split("=", 1)[1]
        elif re.match(r"^\S", line):
            in_commands = False
        if in_commands and _TEST_ENV.match(section):
            if line.rstrip().endswith("\\"):
                held += line.strip()[:-1].strip() + " "
                continue
            step = _step("python", _substituted(held + line.strip()))
            held = ""
            if step:
                return Citation(step, f"{file}:{number}")
    for file, number, line in _lines(root, ("noxfile.py",)):
        found = re.search(r"session\.run\(\s*((?:['\"][^'\"]*['\"]\s*,?\s*)+)", line)
        words = re.findall(r"['\"]([^'\"]*)['\"]", found.group(1)) if found else []
        if words[:1] == ["pytest"] or words[:3] == ["python", "-m", "pytest"]:
            return Citation(" ".join(words), f"{file}:{number}")
    target = ""
    for file, number, line in _lines(root, ("Makefile",)):
        target = line if re.match(r"^[^\s#][^=]*:(?!=)", line) else target
        if line.startswith("\t") and _TEST_TARGET.match(target) and (step := _step("python", line)):
            return Citation(step, f"{file}:{number}")
    for file, number, line in _lines(root, ("pyproject.toml",)):
        script = re.match(r"^\s*[\w\"'.-]*tests?[\w\"'.-]*\s*=\s*['\"]([^'\"]+)['\"]", line)
        if script and (step := _step("python", _substituted(script.group(1)))):
            return Citation(step, f"{file}:{number}")
    return None


def cite(root: Path, system: str) -> Citation | None:
    """Rule 3: the project's test command and where it is written, in the rule's order of preference — the CI
    file, tox.ini/noxfile, ``scripts.test``, the build file's test target, the README (a line that runs it)."""
    for file, number, line in _lines(root, CI_FILES):
        step = _step(system, line)
        if step:
            return Citation(_command(system, step, root), f"{file}:{number}")
    if system == "python" and (found := _python(root)):
        return found
    if system == "npm":
        for file, number, line in _lines(root, ("package.json",)):
            script = re.match(r'^\s*"test"\s*:\s*"(.*)",?\s*$', line)
            if script and "no test specified" not in script.group(1) and script.group(1).strip():
                return Citation("npm test", f"{file}:{number}")
    if system in BUILD_FILE_TESTS:
        globs, pattern = BUILD_FILE_TESTS[system]
        for file, number, line in _lines(root, globs):
            declared = pattern.search(line)
            if declared is None:
                continue
            if system in ("autotools", "make"):
                target = declared.group(1) if system == "make" else ("test" if line.startswith("test") else "check")
                return Citation(_command(system, f"make {target}", root), f"{file}:{number}")
            step = {"cargo": "cargo test", "maven": "mvn test", "gradle": "gradle test"}.get(system)
            if system == "go":
                step = _step("go", line) if "go test" in line else "go test ./..."
            return Citation(_command(system, step or "", root), f"{file}:{number}")
    for file, number, line in _lines(root, ("README*", "readme*")):
        step = _step(system, line)
        if step:
            return Citation(_command(system, step, root), f"{file}:{number}")
    return None


def top_system(root: Path) -> str | None:
    """The system a source's top level runs: the first whose build file is there (a Makefile only without a
    configure script, CMakeLists.txt or meson.build)."""
    for system, files in TOP_FILES.items():
        if any((root / f).is_file() for f in files):
            return system
    return None


# --- the draw ----------------------------------------------------------------------------------------------------

Fetch = Callable[[Project, Path, Path], None]


def key(ecosystem: str, name: str) -> tuple[str, str]:
    """Rule 4's identity: PyPI names compare as PyPI normalises them (``Jinja2`` is ``jinja2``)."""
    return ecosystem, re.sub(r"[-_.]+", "-", name).lower() if ecosystem == "pypi" else name


def judge(candidate: Candidate, known: set[tuple[str, str]], fetch: Fetch, max_bytes: int,
          work: Path) -> tuple[str, Citation | None, Project]:
    """One list entry: ("", citation, project) to keep it, or (why it is skipped, None, project)."""
    project = candidate.project()
    if key(candidate.ecosystem, candidate.name) in known:
        return "already in the corpus", None, project
    if candidate.skip:
        return candidate.skip, None, project
    if candidate.native:
        return "a native Debian package: no upstream artefact", None, project
    if candidate.size > max_bytes:
        return f"over {max_bytes >> 20} MiB ({candidate.size >> 20} MiB of upstream tarballs)", None, project
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src"
        try:
            fetch(project, root, work)
        except Exception as e:  # rule 1: not served, or does not unpack
            suggested = re.search(r"perhaps you meant:\s*`?([\w-]+)", str(e))
            if candidate.ecosystem == "crates" and suggested and suggested.group(1) != candidate.name:
                return judge(replace(candidate, name=suggested.group(1)), known, fetch, max_bytes, work)
            reason = " ".join(str(e).split())
            return f"not served or does not unpack: {reason[-160:]}", None, project
        if not carries_tests(root):
            return "ships no tests", None, project
        top = top_system(root)
        if candidate.ecosystem == "debian" and top != candidate.list:
            return f"top runs {top or 'no known system'}, not {candidate.list}", None, project
        citation = cite(root, candidate.list)
        if citation is None:
            return "no test command can be cited", None, project
        return "", citation, candidate.project(citation.test, citation.cite)


def read_log(log: Path = LOG) -> list[dict[str, str]]:
    return list(_tsv(log)) if log.is_file() else []


def draw_list(entries: Iterable[Candidate], known: set[tuple[str, str]], stop_at: int, log: Path,
              fetch: Fetch = fetch_sources, max_bytes: int = 64 << 20, work: Path = CACHE / "downloads") -> int:
    """Apply the rule to one list, appending each entry looked at to the log, from where the log left off; returns
    how many the list keeps."""
    entries = list(entries)
    if not entries:
        return 0
    done = [r for r in read_log(log) if r["list"] == entries[0].list]
    kept = sum(r["outcome"] == "kept" for r in done)
    last = max((int(r["position"]) for r in done), default=0)
    new = not log.is_file()
    with log.open("a", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\", lineterminator="\n")
        if new:
            writer.writerow(COLUMNS)
        for candidate in entries:
            if kept >= stop_at:
                break
            if candidate.position <= last:
                continue
            reason, citation, project = judge(candidate, known, fetch, max_bytes, work)
            if not reason:
                kept += 1
                known.add(key(project.ecosystem, project.name))
            writer.writerow((candidate.list, candidate.position, project.ecosystem, project.name, project.version,
                             "skipped" if reason else "kept", reason.replace("\t", " "),
                             citation.test if citation else "", citation.cite if citation else ""))
            handle.flush()
            print(f"{candidate.list} #{candidate.position} {project.name} {project.version}: {reason or 'kept'}",
                  flush=True)
    return kept


def drawn_projects(log: Path = LOG) -> list[Project]:
    return [Project(r["ecosystem"], r["name"], r["version"], r["list"], r["test"], DRAWN, r["cite"],
                    half_of(r["ecosystem"], r["name"]))
            for r in read_log(log) if r["outcome"] == "kept"]


def _toml(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_manifest(manifest: Path = MANIFEST, log: Path = LOG) -> int:
    """Append the log's kept projects that the manifest does not have yet; returns how many."""
    present = {(p.ecosystem, p.name) for p in projects()} if manifest == MANIFEST else set()
    new = [p for p in drawn_projects(log) if (p.ecosystem, p.name) not in present]
    with manifest.open("a") as handle:
        for p in new:
            handle.write("\n[[project]]\n" + "".join(
                f"{key} = {_toml(getattr(p, key))}\n"
                for key in ("ecosystem", "name", "version", "system", "test", "cite", "drawn", "half")))
    return len(new)


def counts(every: Iterable[Project]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for p in every:
        table.setdefault(p.system, {"reporting": 0, "tuning": 0})[p.half] += 1
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rule = tomllib.loads(MANIFEST.read_text())["draw"]
    parser.add_argument("--lists", nargs="*", default=rule["lists"], choices=rule["lists"])
    parser.add_argument("--write", action="store_true", help="append the kept projects to projects.toml")
    parser.add_argument("--counts", action="store_true", help="projects per system and half")
    args = parser.parse_args()
    if args.write:
        print(f"appended {write_manifest()} drawn projects to {MANIFEST}")
        return
    if args.counts:
        for system, halves in sorted(counts(projects()).items()):
            print(f"{system:10} reporting {halves['reporting']:3}  tuning {halves['tuning']:3}")
        return
    known = {key(p.ecosystem, p.name) for p in [*projects(), *drawn_projects()]}
    cache: dict[str, str] = {}

    def sources() -> dict[str, str]:
        if not cache:
            cache.update(debian_sources())
        return cache

    for system in args.lists:
        kept = draw_list(candidates(system, sources), known, rule["stop_at"], LOG, max_bytes=rule["max_bytes"])
        print(f"LIST {system}: {kept} kept" + ("" if kept >= rule["stop_at"] else " (the list is exhausted)"),
              flush=True)


if __name__ == "__main__":
    main()
