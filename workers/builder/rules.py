"""How to build a checkout: ordered, explainable rules keyed by *build system*, not language.

``plan(checkout)`` looks at the files only (no build runs here) and returns a ``Plan`` with every decision and its
reason. Rules, in priority order: cmake, autotools, meson, cargo, go, maven, gradle, python, npm, make (and a test
suite in a subdirectory: ``make -C tests``, ``tests/CMakeLists.txt``); a repository's own Dockerfile, when present,
is the image recipe and the detected system supplies the test command. Ambiguity: the project's CI configuration
decides (the system whose tool it runs), else a CMakeLists.txt beats a Makefile (usually generated or stale), else
priority order. Bump ``RULES_VERSION`` whenever a change could alter a build: it is part of the build cache key.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from kiln.schemas.builder import Decision
from kiln.schemas.images import REPORTS_DIR
from kiln.workers.builder import reporters, system_packages
from kiln.workers.builder.dockerfile import confine
from kiln.workers.builder.errors import PlanError, ToolchainUnavailable
from kiln.workers.common import reports

RULES_VERSION = 14
TOOLCHAIN = {"python": (3, 11), "go": (1, 26), "rust": (1, 95), "node": (20, 0)}
LOCAL_IMAGE_MARK = "@kiln-local-image:"  # followed by "base" or "toolchain"; replaced by the real tag at build time
PRIORITY = ["cmake", "autotools", "meson", "cargo", "go", "maven", "gradle", "python", "npm", "make"]
CI_TOOLS = {
    "python": re.compile(r"\b(pytest|tox|nox|unittest)\b"),
    "go": re.compile(r"\bgo (test|build|vet)\b"),
    "cargo": re.compile(r"\bcargo (test|build|check)\b"),
    "npm": re.compile(r"\b(npm|yarn|pnpm|npx)\b"),
    "cmake": re.compile(r"\b(cmake|ctest)\b"),
    "autotools": re.compile(r"(^|\s)\./configure\b|\bautoreconf\b"),
    "make": re.compile(r"(^|[;&|]\s*)make\b"),
    "meson": re.compile(r"\bmeson\b"),
    "maven": re.compile(r"(^|\s|/)mvnw?\b"),
    "gradle": re.compile(r"(^|\s|/)gradlew?\b"),
}
# Hub images whose role the local toolchain image (Debian bookworm + Go, Rust, Python 3.11, Node 20) can fill.
LOCAL_BASES = {"python": "toolchain", "golang": "toolchain", "rust": "toolchain", "node": "toolchain",
               "gcc": "toolchain", "buildpack-deps": "toolchain", "debian": "base"}


CiJobs = list[tuple[str, list[str]]]


@dataclass
class Plan:
    system: str
    recipe: str  # "rules" or "dockerfile"
    decisions: list[Decision]
    toolchain: dict[str, str]
    manifests: list[str]  # files whose content keys the dependency layer
    deps_script: str
    build_script: str
    test_script: str
    env: dict[str, str] = field(default_factory=dict)
    dockerfile: str | None = None  # the repository's Dockerfile with FROM lines mapped to local images
    lint_script: str = ""  # what the exec stage runs for "lint" on an image of this project
    alternatives: list[str] = field(default_factory=list)  # other systems present, tried when this one fails
    # Debian packages the build needs beyond the toolchain image (a JDK and Maven, meson): a layer on it, built the
    # first time a project needs that set (images.toolchain_image), so only such projects pay for it.
    packages: list[str] = field(default_factory=list)

    def decide(self, topic: str, choice: str, reason: str) -> None:
        self.decisions.append(Decision(topic=topic, choice=choice, reason=reason))


def detect(root: Path) -> list[tuple[str, str]]:
    """(system, evidence) for every build system whose marker files are present, in priority order."""
    markers = {
        "cmake": ["CMakeLists.txt"], "autotools": ["configure"], "cargo": ["Cargo.toml"], "go": ["go.mod"],
        "python": ["pyproject.toml", "setup.py", "setup.cfg"], "npm": ["package.json"],
        "make": ["Makefile", "makefile", "GNUmakefile"], "meson": ["meson.build"], "maven": ["pom.xml"],
        "gradle": ["build.gradle", "build.gradle.kts", "settings.gradle", "settings.gradle.kts"],
    }
    found = []
    for system in PRIORITY:
        present = [m for m in markers[system] if (root / m).is_file()]
        if system == "autotools":
            # A generated configure (with Makefile.in or configure.ac beside it), or configure.ac + Makefile.am to
            # generate it from; a lone hand-written configure script is not autotools.
            generated = present and any((root / m).is_file() for m in ("Makefile.in", "configure.ac"))
            sources = [m for m in ("configure.ac", "Makefile.am") if (root / m).is_file()]
            present = present if generated else (sources if len(sources) == 2 else [])
        if system == "go" and not present and _go_sources(root):
            present = ["Go sources without go.mod"]
        if present:
            found.append((system, ", ".join(present)))
    return found


def _go_sources(root: Path) -> list[Path]:
    """Go files at the root or one directory down (a package from before modules has no go.mod)."""
    return [*root.glob("*.go"), *root.glob("*/*.go")]


def ci_jobs(root: Path) -> list[tuple[str, list[str]]]:
    """(job, shell commands) for every job of the project's CI (GitHub Actions, GitLab CI, Travis), in file order;
    the job is ``<file>:<job id or name>``."""
    files = sorted((root / ".github" / "workflows").glob("*.y*ml")) if (root / ".github" / "workflows").is_dir() else []
    files += [p for p in (root / ".gitlab-ci.yml", root / ".travis.yml") if p.is_file()]
    jobs: list[tuple[str, list[str]]] = []
    for path in files:
        try:
            doc = yaml.safe_load(path.read_text(errors="replace"))
        except yaml.YAMLError:
            continue
        named = doc.get("jobs") if isinstance(doc, dict) and isinstance(doc.get("jobs"), dict) else None
        if named is None and isinstance(doc, dict) and path.name == ".gitlab-ci.yml":
            named = {k: v for k, v in doc.items() if isinstance(v, dict) and "script" in v}
        for job, body in (named or {path.stem: doc}).items():
            label = f"{path.name}:{body.get('name', job) if isinstance(body, dict) else job}"
            commands: list[str] = []
            _collect_commands(body, commands)
            if commands:
                jobs.append((label, commands))
    return jobs


def _collect_commands(node: Any, out: list[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "run" and isinstance(value, str):
                out.extend(line.strip() for line in value.splitlines() if line.strip())
            elif key in ("script", "before_script", "install") and isinstance(value, list | str):
                out.extend(str(v).strip() for v in (value if isinstance(value, list) else [value]))
            else:
                _collect_commands(value, out)
    elif isinstance(node, list):
        for item in node:
            _collect_commands(item, out)


def ci_commands(root: Path) -> list[str]:
    """Every shell command the project's CI runs, in file order."""
    return [c for _job, commands in ci_jobs(root) for c in commands]


NOT_THE_SUITE = re.compile(r"bench|codspeed|perf|doc|lint|format|release|deploy|publish|typing|mypy|fuzz|miri",
                            re.IGNORECASE)
THE_SUITE = re.compile(r"\b(tests?|ci|unit|check|build|main)\b", re.IGNORECASE)


def _ci_test(jobs: list[tuple[str, list[str]]], pattern: str) -> tuple[str, str] | None:
    """The command matching ``pattern`` from the job most like the test suite's: (command, why)."""
    found = [(job, c) for job, commands in jobs for c in commands if re.search(pattern, c)]
    if not found:
        return None

    def score(item: tuple[str, str]) -> int:
        job, command = item
        return (-4 * bool(NOT_THE_SUITE.search(command)) - 2 * bool(NOT_THE_SUITE.search(job.split(":", 1)[1]))
                + bool(THE_SUITE.search(job.split(":", 1)[1])))

    best = max(found, key=score)  # max keeps the first of equals: file order
    passed_over = sorted({job for job, c in found if score((job, c)) < score(best)})
    why = f"CI job {best[0]} runs {best[1]!r}"
    if passed_over:
        why += f" (preferred over {', '.join(passed_over)}: benchmarks, docs, lint or release jobs are not the suite)"
    return best[1], why


_FENCE = re.compile(r"^[ \t]*```+[ \t]*([\w-]*)[^\n]*\n(.*?)^[ \t]*```+", re.DOTALL | re.MULTILINE)
_SHELL = {"sh", "bash", "shell", "zsh"}


def readme_commands(root: Path) -> list[str]:
    readme = next((p for p in sorted(root.iterdir()) if p.is_file() and p.name.lower().startswith("readme")), None)
    if readme is None:
        return []
    text = readme.read_text(errors="replace")
    commands: list[str] = []
    for language, block in _FENCE.findall(text):
        if language.lower() not in _SHELL:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ").strip()
            if line and not line.startswith("#"):
                commands.append(line)
    prompts = re.findall(r"^\s*\$ (.+)$", text, re.MULTILINE)  # console blocks and indented examples
    commands += [m.strip() for m in prompts if m.strip() not in commands]
    return commands


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _python_supported(spec: str) -> tuple[bool, str]:
    have = TOOLCHAIN["python"]
    for clause in (c.strip() for c in spec.split(",") if c.strip()):
        m = re.match(r"(>=|<=|==|~=|!=|>|<)\s*([\d.]+)", clause)
        if not m:
            continue
        op, want = m.group(1), _version(m.group(2))[:2]
        ok = {">=": have >= want, ">": have > want, "<=": have <= want, "<": have < want,
              "==": have[:len(want)] == want, "~=": have >= want, "!=": have[:len(want)] != want}[op]
        if not ok:
            return False, clause
    return True, ""


def describe(commits: dict[str, tuple[str, ...]], tags: dict[str, str], commit: str) -> str:
    """A PEP 440 version for ``commit`` from the nearest tag among its ancestors (``git describe``'s idea):
    the tag itself, ``<tag>.post<distance>+g<commit>`` past it, ``0.0.0.post<depth>+g<commit>`` without one.
    ``commits`` maps a commit to its parents."""
    tagged: dict[str, str] = {}
    for name, target in sorted(tags.items()):
        if re.fullmatch(r"v?\d+(\.\d+)*", name):
            tagged.setdefault(target, name.removeprefix("v"))
    frontier, seen, distance = [commit], {commit}, 0
    while frontier:
        hit = next((tagged[c] for c in frontier if c in tagged), None)
        if hit is not None:
            return hit if distance == 0 else f"{hit}.post{distance}+g{commit[:7]}"
        frontier = [p for c in frontier for p in commits.get(c, ()) if p not in seen]
        seen.update(frontier)
        distance += 1
    return f"0.0.0.post{distance}+g{commit[:7]}"


VCS_VERSIONED = re.compile(r"setuptools[_-]scm|hatch-vcs|hatch_vcs|versioneer|pdm-backend|poetry-dynamic-versioning|"
                           r"setuptools-git-versioning|dunamai", re.IGNORECASE)


def plan(root: Path, version: str = "0.0.0", exclude: set[str] | frozenset[str] = frozenset()) -> Plan:
    """``version``: what the revision would be called by its VCS metadata (``describe``), handed to projects that
    take their version from git (the checkout has no ``.git``). ``exclude``: systems (or ``dockerfile``) that
    already failed to build this checkout; the next one present is planned, and ``Plan.alternatives`` lists the
    ones left after it."""
    found = [(s, e) for s, e in detect(root) if s not in exclude]
    jobs = ci_jobs(root)
    ci = [c for _job, commands in jobs for c in commands]
    has_dockerfile = (root / "Dockerfile").is_file() and "dockerfile" not in exclude
    if not found and not has_dockerfile:
        suite = subdirectory_suite(root, jobs) if "make" not in exclude else None
        if suite is not None:
            p = Plan(system="make", recipe="rules", decisions=[Decision(
                topic="detected", choice="make", reason=f"nothing to build at the root; {suite[0]}/ has a Makefile")],
                toolchain={}, manifests=[], deps_script="true", build_script="true", test_script="false")
            _make_suite(root, p, suite)
            return p
        nested = [d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".") and detect(d)]
        # A conventional test directory with its own build (tests/CMakeLists.txt) beats docs/ or examples/ beside it.
        conventional = [d for d in nested if d.name in SUITE_DIRECTORIES]
        if len(nested) == 1 or len(conventional) == 1:
            chosen = nested[0] if len(nested) == 1 else conventional[0]
            return _in_subdirectory(plan(chosen, version, exclude), chosen.name, "the only first-level directory "
                                    "with a build system" if len(nested) == 1 else "the conventional test directory "
                                    f"among those with a build system ({', '.join(d.name for d in nested)})")
        raise PlanError("no rule matched: none of CMakeLists.txt, configure, Cargo.toml, go.mod or Go sources, "
                        "pyproject.toml, setup.py, package.json, Makefile or Dockerfile at the repository root"
                        + (f" besides {', '.join(sorted(exclude))}, which failed" if exclude else ""))
    decisions = [Decision(topic="detected", choice=s, reason=f"found {evidence}") for s, evidence in found]
    systems = [s for s, _ in found]
    system, reason = (systems[0], "the only build system present") if len(systems) == 1 else ("", "")
    if len(systems) > 1:
        used = [s for s in systems if any(CI_TOOLS[s].search(c) for c in ci)]
        if len(used) == 1:
            system, reason = used[0], f"CI runs {next(c for c in ci if CI_TOOLS[used[0]].search(c))!r}"
        elif "cmake" in systems and "make" in systems and set(systems) <= {"cmake", "make"}:
            system, reason = "cmake", "CMakeLists.txt beats a Makefile next to it (usually generated or stale)"
        else:
            system, reason = systems[0], f"several systems ({', '.join(systems)}); first by rule priority"
    if not system:
        system, reason = "dockerfile", "only a Dockerfile"
    p = Plan(system=system, recipe="rules", decisions=decisions, toolchain={}, manifests=[], deps_script="true",
             build_script="true", test_script="false", alternatives=[s for s in systems if s != system])
    p.decide("build system", system, reason)
    RULE_FUNCTIONS.get(system, _no_tests)(root, p, jobs)
    _vcs_version(root, p, version)
    if has_dockerfile:
        try:
            p.dockerfile = map_dockerfile((root / "Dockerfile").read_text(errors="replace"), p)
            p.recipe = "dockerfile"
            if system != "dockerfile":
                p.alternatives.insert(0, system)
        except PlanError as e:
            if system == "dockerfile":
                raise
            p.decide("recipe", "rules", f"the repository's Dockerfile cannot be used ({e}); the {system} rules "
                                        "build it instead")
    return p


def _in_subdirectory(p: Plan, sub: str, why: str) -> Plan:
    """A plan made for a subdirectory with a build system, run from the repository root."""
    where = f"cd {shlex.quote(sub)} && "
    p.decisions.insert(0, Decision(topic="project directory", choice=sub, reason=f"nothing to build at the root; "
                                   f"{why}"))
    p.manifests = [f"{sub}/{m}" for m in p.manifests]
    # The dependency layer holds the manifests only: the directory exists there only if one of them is in it.
    p.deps_script, p.build_script, p.test_script = (f"mkdir -p {shlex.quote(sub)} && {where}{p.deps_script}",
                                                    where + p.build_script, where + p.test_script)
    p.lint_script = where + p.lint_script if p.lint_script else ""
    return p


TEST_GROUP = re.compile(r"^(tests?|testing|dev|ci)$|test", re.IGNORECASE)
TEST_REQUIREMENT_FILES = ("requirements*.txt", "requirements/*.txt", "requirements/*.in", "*requirements*.txt",
                          "tests/requirements*.txt")


def _group(groups: dict[str, Any], name: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """A PEP 735 dependency group, its ``include-group`` entries resolved."""
    out: list[str] = []
    for item in groups.get(name, []) if name not in seen else []:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("include-group"), str):
            out += _group(groups, item["include-group"], seen | {name})
    return out


def tox_requirement_files(root: Path) -> list[str]:
    """The requirement files tox's ``[testenv] deps`` installs (``-r file``), relative to the root, those present."""
    cfg = configparser.ConfigParser(interpolation=None, strict=False)
    with contextlib.suppress(configparser.Error, OSError):
        cfg.read_string((root / "tox.ini").read_text(errors="replace"))
    found = [m.group(1) for line in cfg.get("testenv", "deps", fallback="").splitlines()
             for m in [re.match(r"^-r\s*(\S+)$", line.strip())] if m and "{" not in m.group(1)]
    return [f for f in found if (root / f).is_file()]


def _referenced(root: Path, files: list[str]) -> list[str]:
    """The files, and the requirement and constraint files they name (``-r``, ``-c``), transitively: all of them
    must be in the dependency layer for pip to read the first."""
    out: list[str] = []
    todo = list(files)
    while todo:
        name = todo.pop(0)
        if name in out or name.startswith("..") or not (root / name).is_file():  # only the checkout's own
            continue
        out.append(name)
        for m in re.finditer(r"^\s*(?:-r|-c|--requirement|--constraint)[\s=]*(\S+)",
                             (root / name).read_text(errors="replace"), re.MULTILINE):
            todo.append(os.path.normpath(Path(name).parent / m.group(1)))
    return out


def _python_test_dependencies(root: Path, doc: dict[str, Any], p: Plan) -> list[str]:
    """What the test suite needs besides the project: test-like extras (pyproject, setup.cfg), PEP 735 groups,
    tox's testenv deps; each source recorded as a decision."""
    deps: list[str] = []
    extras = doc.get("project", {}).get("optional-dependencies", {})
    groups = doc.get("dependency-groups", {})
    if (root / "setup.cfg").is_file():
        cfg = configparser.ConfigParser(interpolation=None)
        with contextlib.suppress(configparser.Error):
            cfg.read_string((root / "setup.cfg").read_text(errors="replace"))
            if cfg.has_section("options.extras_require"):
                section = cfg["options.extras_require"]
                extras = {**{k: [x for x in v.splitlines() if x.strip()] for k, v in section.items()}, **extras}
    for kind, table in (("extra", extras), ("dependency group", groups)):
        for name in [n for n in table if TEST_GROUP.search(n)]:
            found = [str(d) for d in extras[name]] if kind == "extra" else _group(groups, name)
            deps += found
            p.decide("test dependencies", f"{kind} {name}", f"{len(found)} requirements for the tests")
    if (root / "tox.ini").is_file():
        cfg = configparser.ConfigParser(interpolation=None, strict=False)
        with contextlib.suppress(configparser.Error):
            cfg.read_string((root / "tox.ini").read_text(errors="replace"))
            lines = [x.strip() for x in cfg.get("testenv", "deps", fallback="").splitlines()]
            # Factor-conditional lines ("py311: x"), includes, URLs and substitutions are tox's own business.
            found = [x for x in lines if x and not x.startswith(("-", "#", ".")) and "{" not in x
                     and not re.match(r"^[\w,!-]+:\s", x) and "://" not in x]
            deps += found
            if found:
                p.decide("test dependencies", "tox testenv deps", f"{len(found)} requirements")
    return deps


_PYTEST_LINE = re.compile(r"(?:^|\s)(?:python\d?(?:\.\d+)? -m |coverage run (?:\S+ )*?-m )?(?:pytest|py\.test)\b(.*)$")

def _tox_args(line: str) -> str:
    """The arguments of a tox command's pytest (``_PYTEST_LINE`` matched), substitutions as tox would leave them
    for kiln's run: ``{posargs:tests}`` runs tests when none are given; other substitutions are tox's business, and
    so is the option that takes one: "--basetemp={envtmpdir}" kept as "--basetemp=" would make pytest use (and
    first empty) the working directory."""
    m = _PYTEST_LINE.search(line)
    assert m is not None
    args = re.sub(r"\{posargs\}", "", re.sub(r"\{posargs:([^}]*)\}", r"\1", m.group(1)))
    args = re.sub(r"(?:(?<=\s)-[\w-]+[= ])?\{[^}]*\}", "", f" {args}")
    return re.sub(r"\s+", " ", args).strip()


def _tox_ini_commands(text: str) -> list[tuple[str, str]]:
    """(environment, command) of an ini-style tox configuration, as tox reads it: a line ending in a backslash
    continues on the next; ``[testenv]`` first, then the ``[testenv:NAME]`` sections (docs, lint and the like last)."""
    cfg = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        cfg.read_string(text)
    except configparser.Error:
        return []
    sections = [s for s in cfg.sections() if s == "testenv" or s.startswith("testenv:")]
    sections.sort(key=lambda s: (s != "testenv", bool(NOT_THE_SUITE.search(s))))  # stable: file order
    return [(section, line.strip()) for section in sections
            for line in re.sub(r"\\[ \t]*\n[ \t]*", " ", cfg.get(section, "commands", fallback="")).splitlines()
            if line.strip()]


def _tox_toml_commands(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(environment, command) of tox 4's TOML configuration (tox.toml, or pyproject's ``[tool.tox]``):
    ``env_run_base.commands`` and ``env.NAME.commands``, each command a list of arguments."""
    envs = [("env_run_base", doc.get("env_run_base", {}))] + [
        (f"env.{name}", body) for name, body in sorted(doc.get("env", {}).items(), key=lambda e: bool(
            NOT_THE_SUITE.search(e[0])))]
    return [(env, " ".join(shlex.quote(str(a)) if not str(a).startswith("{") else str(a) for a in command))
            for env, body in envs if isinstance(body, dict)
            for command in body.get("commands", []) if isinstance(command, list)]


def _nox_commands(text: str) -> list[str]:
    """The commands of noxfile.py's ``session.run(…)`` calls, their string arguments joined (``*session.posargs``
    and other expressions left out)."""
    commands = []
    for m in re.finditer(r"session\.run\(", text):
        depth, end = 1, m.end()
        while end < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        arguments = re.split(r"\b\w+\s*=", text[m.end():end - 1])[0]  # keyword arguments (env=, …) are no words
        commands.append(" ".join(shlex.quote(a) for a in re.findall(r"[\"']([^\"']*)[\"']", arguments)))
    return commands


def task_runner_pytest(root: Path) -> tuple[str, str] | None:
    """(pytest arguments, where they come from) for a project tested through tox or nox: the pytest command of tox's
    test environments (tox.ini, setup.cfg's ``[testenv]``, pyproject's ``legacy_tox_ini``, tox 4's tox.toml and
    ``[tool.tox]``), else of noxfile.py's ``session.run(…)`` calls (``pytest``, ``python -m pytest``, ``coverage
    run -m pytest``); substitutions (``{posargs}``) dropped."""
    sources: list[tuple[str, list[tuple[str, str]]]] = []
    for name in ("tox.ini", "setup.cfg"):
        if (root / name).is_file():
            sources.append((name, _tox_ini_commands((root / name).read_text(errors="replace"))))
    for name in ("tox.toml", "pyproject.toml"):
        if (root / name).is_file():
            with contextlib.suppress(tomllib.TOMLDecodeError):
                doc = tomllib.loads((root / name).read_text())
                tox = doc.get("tool", {}).get("tox", {}) if name == "pyproject.toml" else doc
                if isinstance(tox.get("legacy_tox_ini"), str):
                    sources.append((f"{name} [tool.tox]", _tox_ini_commands(tox["legacy_tox_ini"])))
                elif isinstance(tox, dict):
                    sources.append((name, _tox_toml_commands(tox)))
    for name, commands in sources:
        for env, command in commands:
            if _PYTEST_LINE.search(command):
                return _tox_args(command), f"{name}'s {env} runs {command!r}"
    if (root / "noxfile.py").is_file():
        for command in _nox_commands((root / "noxfile.py").read_text(errors="replace")):
            if _PYTEST_LINE.search(command):
                args = _tox_args(command)
                return args, f"noxfile.py runs pytest {args}".strip()
    return None


def _vcs_version(root: Path, p: Plan, version: str) -> None:
    build_files = [root / m for m in ("pyproject.toml", "setup.py", "setup.cfg") if (root / m).is_file()]
    tool = next((m.group(0) for f in build_files for m in [VCS_VERSIONED.search(f.read_text(errors="replace"))] if m),
                None)
    if tool is None:
        return
    # setuptools-scm (and hatch-vcs, which uses it), pdm-backend, poetry-dynamic-versioning, setuptools-git-versioning
    p.env.update({"SETUPTOOLS_SCM_PRETEND_VERSION": version, "PDM_BUILD_SCM_VERSION": version,
                  "POETRY_DYNAMIC_VERSIONING_BYPASS": version, "SETUPTOOLS_GIT_VERSIONING_VERSION": version})
    p.decide("version", version, f"{tool} reads the version from git, which a build context has not: the nearest "
                                 "tag and distance from Saucer, through the tool's pretend-version variables")


def _python(root: Path, p: Plan, ci: CiJobs) -> None:
    deps: list[str] = []
    doc: dict[str, Any] = {}
    if (root / "pyproject.toml").is_file():
        try:
            doc = tomllib.loads((root / "pyproject.toml").read_text())
        except tomllib.TOMLDecodeError as e:
            raise PlanError(f"pyproject.toml does not parse: {e}") from None
        meta = doc.get("project", {})
        deps = [str(d) for d in meta.get("dependencies", [])]
        if "requires-python" in meta:
            ok, clause = _python_supported(str(meta["requires-python"]))
            p.toolchain["python"] = f"requires {meta['requires-python']}; toolchain 3.11"
            if not ok:
                raise ToolchainUnavailable(f"requires-python {meta['requires-python']!r} excludes the toolchain's "
                                           f"Python 3.11 ({clause})")
    p.toolchain.setdefault("python", "3.11")
    deps += _python_test_dependencies(root, doc, p)
    p.manifests = [m for m in ("pyproject.toml", "setup.py", "setup.cfg", "tox.ini") if (root / m).is_file()]
    files = tox_requirement_files(root) if (root / "tox.ini").is_file() else []
    if files:
        p.decide("test dependencies", " ".join(files), "the requirement files tox's test environment installs")
    else:
        files = sorted({str(r.relative_to(root)) for pattern in TEST_REQUIREMENT_FILES for r in root.glob(pattern)
                        if r.is_file() and not re.search(r"doc|lint|release|bench", r.name, re.IGNORECASE)})
        if files:
            p.decide("test dependencies", " ".join(files), "requirement files (docs, lint, release, bench left out)")
    # A file pip reads may name others (Pallets' dev.in: -r docs.txt): the dependency layer needs them all.
    p.manifests += [f for f in _referenced(root, files) if f not in p.manifests]
    reqs = " ".join(f"-r {shlex.quote(r)}" for r in files)
    pinned = " ".join(shlex.quote(d) for d in deps)
    # Idempotent, so a revision that changes dependencies adds only their delta on top of an existing venv.
    p.deps_script = (f"{{ [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv; }} && /opt/venv/bin/pip "
                     f"install -q pytest coverage ruff {reqs} {pinned}".strip())
    p.lint_script = "/opt/venv/bin/ruff check --output-format=json --exit-zero --no-cache ."
    p.build_script = "/opt/venv/bin/pip install -q --no-build-isolation -e . || /opt/venv/bin/pip install -q -e ."
    args = ""
    from_ci = _ci_test(ci, r"\b(pytest|py\.test|tox|nox)\b")
    runner = None if from_ci and re.search(r"\b(pytest|py\.test)\b", from_ci[0]) else task_runner_pytest(root)
    if from_ci and runner is None and re.search(r"\b(pytest|py\.test)\b", from_ci[0]):
        args = re.split(r"\b(?:pytest|py\.test)\b", from_ci[0], maxsplit=1)[1].strip()
        p.decide("test command", f"pytest {args}".strip(), from_ci[1])
    elif runner is not None:
        args = runner[0]
        p.decide("test command", f"pytest {args}".strip(), f"{from_ci[1] if from_ci else 'no CI test job'}; "
                 f"{runner[1]} (run in kiln's environment, the task runner's own virtualenvs need the network)")
    else:
        p.decide("test command", "pytest", "pyproject/setup.py project; pytest also runs unittest suites"
                 + (f" ({from_ci[1]}, whose configuration names no pytest command)" if from_ci else ""))
    py = "$(command -v /opt/venv/bin/python || command -v python3)"
    # A module that does not import (a task's new tests before the fix) must not hide the others' results; the
    # collection error still makes the run unusable for a build (reports.unusable_reason).
    pytest = (f"-m pytest -q -p no:cacheprovider --continue-on-collection-errors --junitxml={REPORTS_DIR}/junit.xml "
              f"{args}")
    p.test_script = (f"PY={py}; if $PY -c 'import coverage' 2>/dev/null; then "
                     f"$PY -m coverage run --source=. --omit='tests/*,*/tests/*,test_*.py,*/test_*.py,*_test.py' "
                     f"{pytest}; rc=$?; $PY -m coverage json -q -o {REPORTS_DIR}/coverage-py.json; exit $rc; "
                     f"else $PY {pytest}; fi")


def go_module_path(root: Path) -> tuple[str, str]:
    """(module path, how it was found) for Go sources without go.mod: the package's import comment, else the path
    its own files import it by (an import ending in one of its directories, or in the root package's name), else
    a placeholder (then only in-package tests can refer to it, and they need no path)."""
    sources = _go_sources(root)
    for path in sources:
        if path.parent == root:
            m = re.search(r'^package\s+\w+\s*//\s*import\s+"([^"]+)"', path.read_text(errors="replace"),
                          re.MULTILINE)
            if m:
                return m.group(1), f"the import comment in {path.name}"
    local = {str(p.parent.relative_to(root)) for p in sources if p.parent != root}
    names = {m.group(1) for p in sources if p.parent == root and not p.name.endswith("_test.go")
             for m in [re.search(r"^package\s+(\w+)", p.read_text(errors="replace"), re.MULTILINE)] if m}
    counts: dict[str, int] = {}
    for path in sources:
        for imported in re.findall(r'"([\w.-]+\.[\w.-]+/[^"\s]+)"', path.read_text(errors="replace")):
            for module in [imported[: -len(sub) - 1] for sub in local if imported.endswith("/" + sub)] + (
                    [imported] if imported.rsplit("/", 1)[-1] in names else []):  # the root package itself
                counts[module] = counts.get(module, 0) + 1
    if counts:
        module = max(counts, key=lambda m: counts[m])
        return module, f"the sources import their own packages as {module}[/<dir>]"
    return "kiln.local/project", "nothing names the module; in-package tests do not need its path"


def _go(root: Path, p: Plan, ci: CiJobs) -> None:
    p.env = {"GOPATH": "/opt/gopath", "GOFLAGS": "-mod=mod", "GOCACHE": "/work/.cache/go"}  # handed to the test user
    if (root / "go.mod").is_file():
        text = (root / "go.mod").read_text(errors="replace")
        m = re.search(r"^go\s+([\d.]+)", text, re.MULTILINE)
        if m:
            p.toolchain["go"] = f"go.mod says {m.group(1)}; toolchain 1.26"
            if _version(m.group(1))[:2] > TOOLCHAIN["go"]:
                raise ToolchainUnavailable(f"go.mod needs Go {m.group(1)}, newer than the toolchain's 1.26")
        p.manifests = [m for m in ("go.mod", "go.sum") if (root / m).is_file()]
        p.deps_script = "go mod download"
        p.build_script = "go build ./..."
    else:
        module, why = go_module_path(root)
        p.decide("go module", module, f"no go.mod (a package from before modules): {why}; go mod init, then go "
                                      "mod tidy resolves its imports with the sources in place")
        # Language version 1.16: what the go command assumes for a module without a go directive (vet's newer
        # checks in go test, e.g. non-constant format strings, do not apply to such code).
        p.build_script = f"go mod init {shlex.quote(module)} && go mod edit -go=1.16 && go mod tidy && go build ./..."
    if not (root / "go.sum").is_file():
        # Nothing to check downloads against, and the checksum database is not reachable from a build.
        p.env["GOSUMDB"] = "off"
        p.decide("checksums", "GOSUMDB=off", "no go.sum: module checksums are recorded, not verified")
    p.lint_script = "go vet ./... 2>&1; true"
    packages = "./..."
    from_ci = _ci_test(ci, r"\bgo test\b")
    if from_ci:
        packages = " ".join(a for a in from_ci[0].split("go test", 1)[1].split() if not a.startswith("-")) or "./..."
        p.decide("test command", f"go test {packages}", from_ci[1])
    else:
        p.decide("test command", "go test ./...", "go.mod project")
    vet = "" if (root / "go.mod").is_file() else " -vet=off"
    if vet:
        p.decide("vet", "off", "code from before modules was written for older toolchains, whose go test did not "
                               "refuse the checks vet has since gained")
    p.test_script = (f"GOPROXY=off go test{vet} -json -coverprofile={REPORTS_DIR}/cover.out {packages} "
                     f"> {REPORTS_DIR}/go-test.json")


def _cargo_stub_paths(root: Path, manifests: list[str]) -> list[str]:
    """Source files a manifest names or implies (lib, main, bins, tests, benches, examples, build script)."""
    paths: list[str] = []
    for manifest in manifests:
        try:
            doc = tomllib.loads((root / manifest).read_text(errors="replace"))
        except tomllib.TOMLDecodeError as e:
            raise PlanError(f"{manifest} does not parse: {e}") from None
        if "package" not in doc:
            continue  # a virtual workspace root
        base = Path(manifest).parent
        wanted = ["src/lib.rs", "src/main.rs"]
        if isinstance(doc.get("lib"), dict) and "path" in doc["lib"]:
            wanted.append(str(doc["lib"]["path"]))
        build = doc["package"].get("build")
        if isinstance(build, str):
            wanted.append(build)
        for kind, folder in (("bin", "src/bin"), ("test", "tests"), ("bench", "benches"), ("example", "examples")):
            for target in doc.get(kind, []):
                if isinstance(target, dict):
                    wanted.append(str(target.get("path") or f"{folder}/{target.get('name', kind)}.rs"))
        paths += [str(base / w) for w in wanted]
    return sorted(set(paths))


def _cargo(root: Path, p: Plan, ci: CiJobs) -> None:
    for name in ("rust-toolchain.toml", "rust-toolchain"):
        if (root / name).is_file():
            channel = re.search(r"([\w.-]+)\s*\"?\s*$", (root / name).read_text().strip().splitlines()[-1])
            p.toolchain["rust"] = f"{name} asks for {channel.group(1) if channel else '?'}; toolchain 1.95 stable"
    p.toolchain.setdefault("rust", "1.95")
    manifests = sorted(str(m.relative_to(root)) for m in root.rglob("Cargo.toml")
                       if not any(part.startswith(".") or part == "target" for part in m.relative_to(root).parts))
    p.manifests = manifests + [m for m in ("Cargo.lock", ".cargo/config.toml", ".cargo/config") if (root / m).is_file()]
    # Instrumented once at build time; the test run reuses the same flags, so nothing is rebuilt.
    p.env = {"CARGO_TARGET_DIR": "/work/target", "RUSTFLAGS": "-C instrument-coverage",
             "LLVM_PROFILE_FILE": f"{REPORTS_DIR}/prof/%p-%m.profraw"}
    # Fetch against stub sources, so this layer depends on the manifests only: every target a manifest declares (a
    # missing one fails the manifest), every workspace member; cargo fetch takes dev-dependencies and all targets,
    # and writes Cargo.lock when the repository has none (it stays, so the offline build resolves the same).
    stubs = " ".join(shlex.quote(s) for s in _cargo_stub_paths(root, manifests))
    p.deps_script = (f"for f in {stubs}; do mkdir -p \"$(dirname \"$f\")\" && echo 'fn main(){{}}' > \"$f\"; done; "
                     f"cargo fetch && rm -f {stubs}")
    if not (root / "Cargo.lock").is_file():
        p.decide("lockfile", "generated", "no Cargo.lock: cargo fetch resolves one in the dependency layer")
    p.build_script = "cargo test --no-run --offline -q"
    p.lint_script = "cargo check --offline --message-format=short 2>&1; true"
    p.decide("test command", "cargo test --no-fail-fast", "Cargo project; every test binary runs, though an earlier "
                                                           "one failed")
    p.decide("coverage", "llvm source-based", "-C instrument-coverage, llvm-profdata/llvm-cov 22 (rustc's LLVM)")
    objects = ("$(cargo test --no-run --offline --message-format=json 2>/dev/null | python3 -c \"import json,sys; "
               "print(' '.join('-object ' + m['executable'] for m in map(json.loads, sys.stdin) "
               "if m.get('executable') and m.get('profile', {}).get('test')))\")")
    # --no-fail-fast: every test binary runs, though an earlier one failed (a patch that breaks one unit test must
    # not hide every integration test's result).
    p.test_script = (f"cargo test --offline --no-fail-fast 2>&1 | tee {REPORTS_DIR}/cargo-test.txt; "
                     "rc=${PIPESTATUS[0]}; "
                     f"llvm-profdata merge -sparse {REPORTS_DIR}/prof/*.profraw -o /tmp/kiln-cov.profdata && "
                     f"llvm-cov export -format=lcov -instr-profile=/tmp/kiln-cov.profdata "
                     f"-ignore-filename-regex='/(\\.cargo|rustc|cargo-home)/' {objects} > {REPORTS_DIR}/lcov.info; "
                     "exit $rc")


def npm_test_tools(root: Path, pkg: dict[str, Any]) -> set[str] | None:
    """Dev dependencies the test script (following ``npm run`` chains) or the test files name; None without a
    test script."""
    scripts, dev = pkg.get("scripts", {}), set(pkg.get("devDependencies", {}))
    if "test" not in scripts:
        return None
    text, todo, seen = "", ["test"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in scripts:
            continue
        seen.add(name)
        text += " " + str(scripts[name])
        todo += re.findall(r"npm run(?:-script)? (?:--silent )?([\w:.-]+)", str(scripts[name]))
    tests = [f for d in ("test", "tests", "__tests__", "spec") for f in (root / d).rglob("*.*js")
             if (root / d).is_dir()] + list(root.glob("*.test.*js"))
    for f in tests[:500]:
        text += " " + " ".join(re.findall(r"(?:require\(|from\s+|import\s+)['\"]([^'\"]+)['\"]",
                                          f.read_text(errors="replace")))
    return {d for d in dev if re.search(rf"(^|[\s'\"/(]){re.escape(d)}($|[\s'\"/)])", text)
            or re.search(rf"(^|\s){re.escape(d.split('/')[-1])}(\s|$)", text)}


def _npm(root: Path, p: Plan, ci: CiJobs) -> None:
    try:
        pkg = json.loads((root / "package.json").read_text())
    except ValueError as e:
        raise PlanError(f"package.json does not parse: {e}") from None
    if "node" in pkg.get("engines", {}):
        p.toolchain["node"] = f"engines.node {pkg['engines']['node']}; toolchain 20"
    p.toolchain.setdefault("node", "20")
    if (root / "pnpm-lock.yaml").is_file():
        manager, install = "pnpm", "corepack enable && pnpm install --frozen-lockfile"
    elif (root / "yarn.lock").is_file():
        manager, install = "yarn", "corepack enable && yarn install --frozen-lockfile"
    elif (root / "package-lock.json").is_file():
        manager, install = "npm", "npm ci --no-audit --no-fund"
    else:
        manager, install = "npm", "npm install --no-audit --no-fund"
    p.decide("package manager", manager, "lockfile present" if manager != "npm" or "ci" in install else
             "no lockfile: npm install")
    p.manifests = [m for m in ("package.json", "package-lock.json", "yarn.lock", "pnpm-lock.yaml")
                   if (root / m).is_file()]
    scripts = pkg.get("scripts", {})
    # Lifecycle scripts (prepare: often a TypeScript build) need the sources: not in the manifests-only layer.
    install = f"{install} --ignore-scripts"
    needed = npm_test_tools(root, pkg)
    if manager == "npm" and needed is not None:
        # Dev dependencies the tests never use (linters, release tools) can be uninstallable here (a git URL, a
        # dist-tag the registry lacks): when the full install fails, install the dependencies plus the ones the
        # test script and test files name. The sources' package.json replaces the trimmed one in the next layer.
        keep = json.dumps(sorted(needed))
        trim = ("node -e 'const fs=require(\"fs\"),keep=new Set(" + keep + "),p=JSON.parse(fs.readFileSync("
                "\"package.json\"));for(const k of Object.keys(p.devDependencies||{}))if(!keep.has(k))"
                "delete p.devDependencies[k];fs.writeFileSync(\"package.json\",JSON.stringify(p))'")
        # A version the registry does not serve (yet: real, resolve 1.22.14 asks for tape ^5.10.3, the registry's
        # newest is 5.10.2): last, every range of the package widened to its major (^5), the newest it serves.
        widen = ("node -e 'const fs=require(\"fs\"),p=JSON.parse(fs.readFileSync(\"package.json\"));"
                 "for(const d of [p.dependencies||{},p.devDependencies||{}])for(const k of Object.keys(d)){"
                 "const m=/^[\\^~=v]*(\\d+)\\.\\d+\\.\\d+[^ |]*$/.exec(d[k]);if(m)d[k]=\"^\"+m[1]}"
                 "fs.writeFileSync(\"package.json\",JSON.stringify(p))'")
        install = (f"{{ {install} || {{ echo 'kiln: the full install failed; installing what the tests use: "
                   f"{' '.join(sorted(needed))}'; {trim} && rm -f package-lock.json && npm install --no-audit "
                   "--no-fund --ignore-scripts || { echo 'kiln: that failed too; each version range widened to its "
                   f"major'; {widen} && npm install --no-audit --no-fund --ignore-scripts; }}; }}; }}")
        p.decide("test tools", " ".join(sorted(needed)) or "none", "dev dependencies the test script and test files "
                 "use: what a failed full install falls back to")
    p.deps_script = f"{install} && npm install -g --prefix /opt/c8 c8@10 --no-audit --no-fund"
    steps = ["npm rebuild --no-audit --no-fund"] + [f"npm run {s}" for s in ("prepare", "build") if s in scripts]
    p.build_script = " && ".join(steps)
    p.decide("lifecycle scripts", "after the sources", "dependencies install with --ignore-scripts; npm rebuild, "
                                                       "then prepare and build, run with the sources in place")
    if "test" not in pkg.get("scripts", {}):
        raise PlanError("package.json has no test script")
    # pretest/posttest hooks lint and audit (audits need the network): the suite is scripts.test itself.
    command = f"{manager} test" + (" --ignore-scripts" if manager == "npm" else "")
    found = npm_runner(scripts)
    setup, stdout = "", ""
    if found is not None:
        declared = {**pkg.get("dependencies", {}), **pkg.get("devDependencies", {})}.get(found.runner)
        major = _version(str(declared))[:1] if declared else ()
        command = with_reporter(found.runner, found.command, major[0] if major else None)
        setup = "".join(f"{step} && " for step in found.setup)
        stdout = f" >{REPORTS_DIR}/{STDOUT_REPORTS[found.runner]}" if found.runner in STDOUT_REPORTS else ""
        if found.runner in ("uvu", "jasmine"):
            # The file exists before the runner starts: without a line in it the run has no results (its printed
            # lines, which the code under test shares, are not read instead).
            setup = f": > {REPORTS_DIR}/{found.runner}.tap; {setup}"
            p.deps_script += f" && {reporters.install_script()}"
            p.decide("reporter", f"kiln's {found.runner} reporter", f"{found.runner} has no reporter writing per-test "
                     "results to a file: kiln's writes one line per test, checked against the runner's own summary")
        p.decide("test command", " && ".join([*found.setup, found.command]),
                 f"the {found.runner} command of scripts.test (and the steps before it), run with a reporter writing "
                 "per-test results to a file kiln reads (lint steps and a stop at the first failure left out)")
    else:
        p.decide("test command", command, "package.json scripts.test, without its pre/post hooks (lint, audit); "
                                          "no runner kiln can give a reporter: per-test lines read from its output")
    # Variables the command sets go before c8, which would take the first of them for the program to run.
    env = re.match(r"(?:[A-Za-z_]\w*=\S*\s+)*", command)
    assigned = env.group(0) if env else ""
    # "2>&1 >file": stderr to the pipe, stdout (a runner's TAP) to its report file.
    p.test_script = (f"export PATH=$PWD/node_modules/.bin:$PATH; {setup}{assigned}/opt/c8/bin/c8 --reporter=json "
                     f"--report-dir={REPORTS_DIR} --exclude='test/**' --exclude='**/*.test.*' "
                     f"{command[len(assigned):]} 2>&1{stdout} | tee {REPORTS_DIR}/test-output.txt; "
                     "exit ${PIPESTATUS[0]}")


NPM_RUNNERS = ("mocha", "jest", "vitest", "node", "uvu", "ava", "tap", "jasmine", "qunit")
_LINT_STEP = re.compile(r"^(?:npx\s+)?(?:eslint|standard|semistandard|prettier|xo|tslint|jshint|jscs|markdownlint|"
                        r"attw|depcheck|licensee|aud|npm audit|tsc\b.*--noEmit)\b")
_LINT_SCRIPT = re.compile(r"lint|format|prettier|audit|typecheck|types|check-types|tsd", re.IGNORECASE)


class NpmRunner(NamedTuple):
    """The runner of ``scripts.test``: its name, its command, and the steps the script runs before it (lint left
    out), which the tests may need (a build, a fixture generator)."""

    runner: str
    command: str
    setup: tuple[str, ...] = ()
_SCRIPT_CALL = re.compile(r"^(?:npm run(?:-script)?|yarn run|yarn|pnpm run|pnpm)\s+(?:--silent\s+)?([\w:.-]+)\s*$")
_WRAPPERS = re.compile(r"^(?:(?:[A-Z_][A-Z0-9_]*=\S*|cross-env|npx|nyc|c8|--\S+)\s+)+")


def npm_runner(scripts: dict[str, Any], name: str = "test", seen: frozenset[str] = frozenset()) -> NpmRunner | None:
    """The first step of ``scripts[name]`` (``npm run`` chains followed) that runs mocha, jest, vitest or
    ``node --test``, its environment assignments kept, coverage wrappers (nyc, c8) dropped, with the steps before it
    that are no lint; None when there is none or a step is too complex to rewrite (pipes, subshells, globs kiln
    would change)."""
    script = scripts.get(name)
    if not isinstance(script, str) or name in seen or re.search(r"[|`$()<>]|\|\|", script):
        return None
    setup: list[str] = []
    for step in (x.strip() for x in re.split(r"&&|;", script) if x.strip()):
        call = _SCRIPT_CALL.match(step)
        if call and call.group(1) != "test":
            found = npm_runner(scripts, call.group(1), seen | {name})
            if found:
                return found._replace(setup=(*setup, *found.setup))
            if not _LINT_SCRIPT.search(call.group(1)):
                setup.append(step)
            continue
        wrapped = _WRAPPERS.match(step)
        prefix = wrapped.group(0) if wrapped else ""
        env = " ".join(re.findall(r"(?:^|\s)([A-Z_][A-Z0-9_]*=\S*)", prefix))
        rest = step[len(prefix):]
        words = rest.split()
        if not words:
            continue
        runner = words[0]
        if runner in NPM_RUNNERS and (runner != "node" or "--test" in words):
            return NpmRunner(runner, f"{env} {rest}".strip(), tuple(setup))
        if not _LINT_STEP.match(rest):
            setup.append(step)
    return None


_REPORTER_OPTIONS = re.compile(r"\s(?:(?:--reporter|-R|--reporter-options?|-O|--reporters|--outputFile(?:\.\w+)?|"
                               r"--test-reporter|--test-reporter-destination)(?:[= ](?!-)\S+)?|--json)(?=\s|$)")


# Stop at the first failure (mocha's and jest's --bail/-b, vitest's --bail=N, ava's and jasmine's --fail-fast): the
# tests after it never report, so a patch that breaks one test would score as one that breaks them all (real:
# merge-descriptors 1.0.1, whose first test fails on Node 20 and whose --bail left 1 result of 8).
_BAIL = re.compile(r"\s(?:--bail(?:[= ]\d+)?|-b|--fail-fast)(?=\s|$)")
# Options that change how a runner reports or runs that kiln's reporter cannot live with: jasmine's parallel mode
# refuses reporters added by a helper; node-tap's coverage (nyc, or c8 built in) would be checked at 100 % in tap
# >= 15 and wraps the run kiln's c8 already wraps.
_RUNNER_OPTIONS = re.compile(r"\s(?:--parallel(?:=\S+)?|--100|--check-coverage|--no-check-coverage|--cov|"
                             r"--coverage|--no-coverage|--disable-coverage|--coverage-report(?:[= ]\S+)?|"
                             r"--nyc-arg(?:[= ]\S+)?)(?=\s|$)")
# Runners whose report kiln takes from their stdout (TAP with their own count at the end): the file it goes to.
STDOUT_REPORTS = {"ava": "ava.tap", "qunit": "qunit.tap", "tap": "tap.tap"}


def with_reporter(runner: str, command: str, major: int | None = None) -> str:
    """``command`` with its own reporter options and any stop at the first failure removed, and kiln's reporter
    added: a report file in the reports directory (mocha's xunit, jest's and vitest's JSON, node's TAP, kiln's own
    uvu and jasmine reporters) next to the human output, or TAP on stdout (ava, QUnit, node-tap: ``STDOUT_REPORTS``
    says where the test command sends it). ``major``: the runner's major version, where its options differ (tap)."""
    bare = _BAIL.sub("", _REPORTER_OPTIONS.sub("", f" {command}")).strip()
    if runner in ("ava", "qunit", "tap", "jasmine"):
        bare = _RUNNER_OPTIONS.sub("", f" {bare}").strip()
    if runner == "mocha":
        # _mocha is the runner itself: mocha 1.x's bin/mocha wrapper runs it through a spawn option Node 20 no
        # longer has, and prints nothing (real: etag, methods). "--reporter-options" (plural) is what mocha < 6
        # knows (real: depd's mocha 5 printed its XML to stdout instead).
        bare = re.sub(r"(^|\s)mocha(?=\s|$)", r"\1_mocha", bare, count=1)
        return f"{bare} --reporter xunit --reporter-options output={REPORTS_DIR}/mocha.xml"
    if runner == "jest":
        return f"{bare} --ci --json --outputFile={REPORTS_DIR}/jest.json"
    if runner == "vitest":
        run = "" if re.search(r"\bvitest (run|--run)\b", bare) else " --run"
        return f"{bare}{run} --reporter=default --reporter=json --outputFile.json={REPORTS_DIR}/vitest.json"
    if runner == "uvu":
        return f"{reporters.UVU_REPORT_ENV}={REPORTS_DIR}/uvu.tap {bare}"
    if runner == "jasmine":
        return f"{reporters.JASMINE_REPORT_ENV}={REPORTS_DIR}/jasmine.tap {bare} --helper={reporters.JASMINE_HELPER}"
    if runner == "ava":
        return f"{bare} --tap"
    if runner == "qunit":
        return f"{bare} --reporter tap"
    if runner == "tap":
        # node-tap 18 renamed the options: --reporter=tap and --disable-coverage (before: -R tap, --no-coverage).
        return f"{bare} --reporter=tap --disable-coverage" if (major or 0) >= 18 else f"{bare} -R tap --no-coverage"
    return bare.replace("node ", f"node --test-reporter=tap --test-reporter-destination={REPORTS_DIR}/node-tap.txt "
                                 "--test-reporter=spec --test-reporter-destination=stdout ", 1)


C_COVERAGE_ENV = {"CFLAGS": "--coverage -O0 -g", "CXXFLAGS": "--coverage -O0 -g", "LDFLAGS": "--coverage"}
# Symbols wrapped at link time (ld --wrap): gcov's runtime (libgcov) calls open, close, fcntl, ... itself, so in a
# program that wraps one of them, --coverage leaves __wrap_<symbol> undefined (real: libxcrypt 4.4.33's
# test/getrandom-fallbacks wraps open and close and fails to link, and make check stops before its first test).
_LD_WRAP = re.compile(r"-Wl,--?wrap[,=]\w+")
_MAKE_FILES = ("Makefile.am", "Makefile.in", "Makefile", "makefile", "GNUmakefile", "configure.ac")


def _c_coverage(root: Path, p: Plan) -> None:
    """gcov instrumentation (``C_COVERAGE_ENV``) for a make or autotools build, left out where the project wraps
    symbols at link time: tests that link and run without coverage beat coverage of tests that cannot link."""
    for path in [root / name for name in _MAKE_FILES] + [d / name for d in sorted(root.iterdir()) if d.is_dir()
                                                         for name in _MAKE_FILES[:3]]:
        wrap = _LD_WRAP.search(path.read_text(errors="replace")) if path.is_file() else None
        if wrap:
            p.decide("coverage", "none", f"{path.relative_to(root)} links with {wrap.group(0)!r} (ld --wrap): "
                                         "gcov's runtime calls the wrapped symbols too, and a test program built "
                                         "with --coverage would not link")
            return
    p.env = dict(C_COVERAGE_ENV)


GCOV = (f"find . -name '*.gcda' | while read -r f; do (cd \"$(dirname \"$f\")\" && "
        f"gcov --json-format --stdout \"$(basename \"$f\")\") >> {REPORTS_DIR}/gcov.jsonl 2>/dev/null; done")


C_LINT = ("for f in $(find . -name '*.c' -not -path './build/*'); do gcc -fsyntax-only -Wall -Wextra \"$f\"; "
          "done 2>&1; true")


def _system_packages(root: Path, p: Plan) -> None:
    """The Debian packages the build files require by name (``system_packages``), added to the plan's layer."""
    found = system_packages.required(root, p.system)
    if found:
        p.packages = [*p.packages, *(package for _what, package in found)]
        p.decide("system packages", " ".join(package for _what, package in found),
                 "the build requires " + "; ".join(f"{what}: {package}" for what, package in found)
                 + " (Debian bookworm's packages that ship them, a layer on the toolchain image)")


def _cmake(root: Path, p: Plan, ci: CiJobs) -> None:
    p.manifests = []
    _system_packages(root, p)
    p.lint_script = C_LINT
    flags = "--coverage -O0 -g"
    p.build_script = (f"cmake -S . -B build -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS='{flags}' "
                      f"-DCMAKE_CXX_FLAGS='{flags}' && cmake --build build -j 4")
    p.decide("test command", "ctest", "CMake project (CTest)")
    p.test_script = (f"cd build && ctest --output-on-failure --output-junit {REPORTS_DIR}/ctest.xml; rc=$?; {GCOV}; "
                     "exit $rc")


_TEST_BINARY = re.compile(r"(?:^|&&|;)\s*(\./[\w./-]*test[\w.-]*)(?:\s|$)", re.IGNORECASE)
_BINARY_TARGET = re.compile(r"[\w-]*(?:test|check)[\w-]*", re.IGNORECASE)  # a file target, no extension


MAKEFILES = ("Makefile", "makefile", "GNUmakefile")
SUITE_DIRECTORIES = ("tests", "test", "t", "testing")
_CI_MAKE_IN = re.compile(r"(?:^|[;&|]\s*)(?:make\b[^;&|]*?\s-C\s*(?P<dir>[\w./-]+)(?P<rest>[^;&|]*)|"
                         r"cd\s+(?P<cd>[\w./-]+)\s*&&\s*make\b(?P<after>[^;&|]*))")


def _test_target(text: str) -> str | None:
    targets = re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.MULTILINE)
    return next((t for t in ("test", "check") if t in targets), None) or next(
        (t for t in targets if re.fullmatch(r"(test|check|tests|unittests?|runtests?)([-_.]\w+)?", t)), None)


def subdirectory_suite(root: Path, ci: CiJobs) -> tuple[str, str, str] | None:
    """(directory, make target, why) of a test suite whose Makefile is in a subdirectory: the one CI runs (``make -C
    tests``, ``make -C test check``, ``cd tests && make``; test jobs before docs and release ones), else a
    conventional tests/, test/, t/ or testing/ with a Makefile (its test or check target, else its default one,
    ``""``)."""
    found = _ci_test(ci, _CI_MAKE_IN.pattern)
    if found:
        m = _CI_MAKE_IN.search(found[0])
        assert m is not None
        sub = os.path.normpath(m.group("dir") or m.group("cd"))
        words = [w for w in (m.group("rest") or m.group("after") or "").split()
                 if not w.startswith("-") and "=" not in w]
        if not sub.startswith("..") and any((root / sub / f).is_file() for f in MAKEFILES):
            return sub, words[0] if words else "", found[1]
    for sub in SUITE_DIRECTORIES:
        makefile = next((root / sub / f for f in MAKEFILES if (root / sub / f).is_file()), None)
        if makefile is not None:
            target = _test_target(makefile.read_text(errors="replace")) or ""
            return sub, target, f"{sub}/{makefile.name} (the conventional place of a test suite)" + (
                "" if target else ", its default target")
    return None


def _make_suite(root: Path, p: Plan, suite: tuple[str, str, str]) -> None:
    """The test suite of a subdirectory's Makefile, after the root's own build when it has one."""
    sub, target, why = suite
    run = f"make -C {shlex.quote(sub)}" + (f" {target}" if target else "")
    p.build_script = "make" if any((root / f).is_file() for f in MAKEFILES) else "true"
    p.decide("test command", run, why)
    _c_coverage(root, p)
    p.lint_script = C_LINT
    p.test_script = f"{run} 2>&1 | tee {REPORTS_DIR}/make-check.txt; rc=${{PIPESTATUS[0]}}; {GCOV}; exit $rc"


def _make(root: Path, p: Plan, ci: CiJobs) -> None:
    _system_packages(root, p)
    text = next((root / m).read_text(errors="replace") for m in MAKEFILES if (root / m).is_file())
    targets = re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.MULTILINE)
    target = _test_target(text)
    suite = subdirectory_suite(root, ci)
    if suite is not None and (target is None or _ci_test(ci, _CI_MAKE_IN.pattern)):
        _make_suite(root, p, suite)
        return
    from_ci = _ci_test(ci, r"(^|\s)make\s+(test|check|tests|unittests?|runtests?)\b")
    commands = [c for _job, job_commands in ci for c in job_commands] + readme_commands(root)
    binary = next((m.group(1) for c in commands for m in [_TEST_BINARY.search(c)] if m), None)
    links = r"\s*:[^\n]*\n(?:\t[^\n]*\n)*?\t[^\n]*-o\s+(?:\$@|{0})(?=\s|$)"  # its recipe links it (-o $@)
    built = next((t for t in targets if _BINARY_TARGET.fullmatch(t)
                  and re.search("^" + re.escape(t) + links.format(re.escape(t)), text, re.MULTILINE)), None)
    p.build_script = "make"
    if from_ci:
        target = from_ci[0].split("make", 1)[1].split()[0]
        p.decide("test command", f"make {target}", from_ci[1])
    elif target:
        p.decide("test command", f"make {target}", f"the Makefile has a '{target}' target")
    elif binary:
        p.decide("test command", f"make && {binary}", f"no test target; the README or CI runs the built {binary}")
    elif built:
        binary, p.build_script = f"./{built}", f"make {built}"
        p.decide("test command", f"make {built} && ./{built}", f"no test target, and neither CI nor the README "
                 f"names one; the Makefile's target {built!r} links a test binary (-o $@): it is the suite")
    else:
        raise PlanError("the Makefile has no test target, no target that links a test binary, and neither CI nor "
                        "the README names one or a test binary")
    _c_coverage(root, p)
    p.lint_script = C_LINT
    run = f"make {target}" if target else shlex.quote(binary or "false")
    p.test_script = f"{run} 2>&1 | tee {REPORTS_DIR}/make-check.txt; rc=${{PIPESTATUS[0]}}; {GCOV}; exit $rc"


def stale_configure(root: Path) -> str | None:
    """An input file the shipped configure names (``ac_config_files``) that the sources lack: configure was made
    before the sources were changed (a Debian source package that drops a directory patches configure.ac and
    regenerates at build time; real: gmp's dfsg repack without doc/), so it must be generated again."""
    if not (root / "configure").is_file() or not (root / "configure.ac").is_file():
        return None
    for line in re.findall(r'^ac_config_files="\$ac_config_files ([^"]*)"', (root / "configure").read_text(
            errors="replace"), re.MULTILINE):
        for entry in line.split():
            out, _, inputs = entry.partition(":")
            for source in inputs.split(":") if inputs else [f"{out}.in"]:
                if "$" not in source and not (root / source).is_file() and not (root / f"{out}.am").is_file():
                    return source
    return None


def _autotools(root: Path, p: Plan, ci: CiJobs) -> None:
    _c_coverage(root, p)
    _system_packages(root, p)
    p.build_script = "{ [ -f configure ] || autoreconf -fi; } && sh ./configure && make -j 4"
    missing = stale_configure(root)
    if missing:
        p.build_script = "autoreconf -fi && sh ./configure && make -j 4"
        p.decide("configure", "autoreconf -fi", f"the shipped configure names {missing}, which the sources lack: "
                                                "it predates them, and is generated again from configure.ac")
    p.lint_script = C_LINT
    p.decide("test command", "make check", "autotools (configure, generated by autoreconf when only configure.ac "
                                           "is there): configure, make, make check")
    p.test_script = f"make check 2>&1 | tee {REPORTS_DIR}/make-check.txt; rc=${{PIPESTATUS[0]}}; {GCOV}; exit $rc"


def _no_tests(root: Path, p: Plan, ci: CiJobs) -> None:
    p.decide("test command", "none", "no build system besides the Dockerfile: nothing known to run tests")


# The JVM: Debian bookworm's OpenJDK 17, Maven 3.8 and Gradle 4.4.1 (the only Gradle there is: distributions come
# from services.gradle.org, which builds cannot reach). Their repositories (~/.m2, the Gradle user home) live in the
# dependency layer, filled through the egress proxy from Maven Central, read offline by the tests.
JDK = ["openjdk-17-jdk-headless"]
M2 = "/opt/m2"
MVN = f"mvn -B -ntp -s {M2}/settings.xml"
JACOCO = "org.jacoco:jacoco-maven-plugin:0.8.12"
GRADLE_HOME = "/opt/gradle"
GRADLE = "gradle --no-daemon --console=plain"
DEBIAN_GRADLE = (4, 4, 1)
# Maven's settings: every repository a pom names mirrored by Maven Central (the only one builds reach), through the
# proxy the build step is given ($HTTPS_PROXY: host and port, as Maven and Gradle want them).
_PROXY_PARTS = 'p=${HTTPS_PROXY:-${https_proxy:-}}; p=${p#*://}; p=${p%%/*}; host=${p%:*}; port=${p##*:}; '
_MAVEN_SETTINGS = (
    f"mkdir -p {M2} && {_PROXY_PARTS}{{ echo '<settings><localRepository>{M2}/repository</localRepository>"
    "<mirrors><mirror><id>kiln-central</id><mirrorOf>*</mirrorOf><url>https://repo.maven.apache.org/maven2</url>"
    "</mirror></mirrors><proxies>'; [ -n \"$host\" ] && for proto in https http; do echo \"<proxy><id>kiln-$proto"
    "</id><active>true</active><protocol>$proto</protocol><host>$host</host><port>$port</port></proxy>\"; done; "
    f"echo '</proxies></settings>'; }} > {M2}/settings.xml")
# Gradle's: the proxy as system properties in the Gradle user home, and an init script adding ``kilnResolve`` to
# every project (it resolves the test classpaths, downloading what the tests need).
_GRADLE_SETUP = (
    f"mkdir -p {GRADLE_HOME}/init.d && {_PROXY_PARTS}{{ [ -n \"$host\" ] && for proto in https http; do "
    "echo \"systemProp.$proto.proxyHost=$host\"; echo \"systemProp.$proto.proxyPort=$port\"; done; "
    f"true; }} > {GRADLE_HOME}/gradle.properties && echo "
    "'allprojects { task kilnResolve { doLast { project.configurations.each { c -> "
    "if (c.canBeResolved && c.name =~ /(?i)test.*(runtime|compile)classpath/) { c.resolve() } } } } }' "
    f"> {GRADLE_HOME}/init.d/kiln.gradle")


def _expect(into: str) -> str:
    """Shell making ``into``/ of the reports directory with its marker before the runner starts (a run that leaves
    no report there has no results: ``reports.EXPECTED_REPORTS``)."""
    return f"mkdir -p {REPORTS_DIR}/{into} && : > {REPORTS_DIR}/{into}/{reports.EXPECTED_REPORTS}; "


def _collect(pattern: str, into: str) -> str:
    """Shell copying every file find's ``-path pattern`` matches into ``into``/ of the reports directory, numbered
    (two modules may each have a ``TEST-x.xml``)."""
    return (f"i=0; for f in $(find . -path '{pattern}'); do i=$((i+1)); mkdir -p {REPORTS_DIR}/{into} && "
            f"cp \"$f\" \"{REPORTS_DIR}/{into}/$i-$(basename \"$f\")\"; done")


def _pom_modules(root: Path) -> list[str]:
    """The poms of a Maven build: the root's, and its modules' (``<module>``), transitively."""
    found, todo = [], ["pom.xml"]
    while todo:
        pom = todo.pop(0)
        if pom in found or not (root / pom).is_file():
            continue
        found.append(pom)
        text = re.sub(r"<!--.*?-->", "", (root / pom).read_text(errors="replace"), flags=re.DOTALL)
        for module in re.findall(r"<module>\s*([^<\s]+)\s*</module>", text):
            path = os.path.normpath(Path(pom).parent / module)
            todo.append(path if path.endswith(".xml") else f"{path}/pom.xml")
    return [f for f in found if not f.startswith("..")]


# A Java level JDK 17 no longer compiles (javac 17: "Source option 5 is no longer supported. Use 7 or later"),
# named in a pom's compiler settings or the property they read (real: abego-treelayout's <source>1.5</source>).
_OLD_JAVA_TAG = r"(source|target|[a-z.-]*(jdk|java|compiler)[a-z.-]*)"
_OLD_JAVA = re.compile(rf"<{_OLD_JAVA_TAG}>\s*(1\.[1-6]|[1-6]|jsr14)\s*</\1>", re.IGNORECASE)
_OLD_JAVA_SED = rf"<{_OLD_JAVA_TAG}>[[:space:]]*(1\.[1-6]|[1-6]|jsr14)[[:space:]]*</\1>"


def _maven(root: Path, p: Plan, ci: CiJobs) -> None:
    p.packages = [*JDK, "maven"]
    p.toolchain["java"] = "OpenJDK 17, Maven 3.8 (Debian bookworm)"
    poms = _pom_modules(root)
    p.manifests = poms
    if len(poms) > 1:
        p.decide("modules", str(len(poms) - 1), "a multi-module build: every module's pom is in the dependency layer")
    # go-offline cannot resolve one module's dependency on another from the poms alone (nothing is built yet): in a
    # multi-module build what it leaves, the build step resolves with the sources in place.
    go_offline = f"{MVN} org.apache.maven.plugins:maven-dependency-plugin:3.6.1:go-offline"
    if len(poms) > 1:
        go_offline = (f"{{ {go_offline} || echo 'kiln: go-offline left what the modules need of each other; the "
                      "build resolves the rest'; }")
    p.deps_script = f"{_MAVEN_SETTINGS} && {go_offline}"
    poms_text = " ".join((root / pom).read_text(errors="replace") for pom in poms)
    # Without a source level Maven's default compiler plugin asks for Java 5, which JDK 17 no longer compiles.
    level = "" if re.search(r"maven\.compiler\.(source|release)|<(source|release)>", poms_text) else \
        " -Dmaven.compiler.source=1.8 -Dmaven.compiler.target=1.8"
    if level:
        p.decide("java level", "1.8", "no pom names a source level: Maven's default (Java 5) is older than JDK 17 "
                                      "compiles")
    old = sorted({m.group(0) for m in _OLD_JAVA.finditer(poms_text)})
    raise_level = ""
    if old:
        raise_level = (f"sed -E -i 's#{_OLD_JAVA_SED}#<\\1>1.8</\\1>#gI' "
                       + " ".join(shlex.quote(pom) for pom in poms) + " && ")
        p.decide("java level", "1.8", f"the poms name {', '.join(old)}: JDK 17 compiles Java 7 and later only, so "
                                      "the image's poms ask for 1.8 instead")
    p.decide("dependencies", "Maven Central", "every repository mirrored by Maven Central through kiln's egress proxy "
                                              f"(settings.xml), into {M2}/repository in the dependency layer")
    # The build resolves what only a run asks for (Surefire's provider for the project's test framework, JaCoCo's
    # agent and report) by running the tests with a filter that matches every test class and no test method: a
    # filter matching no class would stop Surefire before it resolves its provider. The test phase, as the test run
    # runs it: ``surefire:test`` by prefix would take the newest Surefire where the pom names none, not the one
    # Maven binds to the phase (real: abego-treelayout's JUnit 4.8.2, which Surefire 3 refuses).
    p.build_script = (f"{raise_level}{MVN}{level} {JACOCO}:prepare-agent test {JACOCO}:report "
                      "'-Dtest=*#kilnResolvesTheRunnerOnly' -Dsurefire.failIfNoSpecifiedTests=false "
                      "-DfailIfNoTests=false")
    from_ci = _ci_test(ci, r"(^|\s|/)mvnw?\b.*\b(test|verify|install|package)\b")
    p.decide("test command", "mvn test", (f"{from_ci[1]}; " if from_ci else "") + "Maven's test phase, offline, every "
             "module tested (--fail-at-end), Surefire's JUnit XML read per test, JaCoCo's report per module")
    p.lint_script = ""
    jacoco = (f"j=0; for f in $(find . -path '*/target/site/jacoco/jacoco.xml'); do j=$((j+1)); "
              f"mkdir -p {REPORTS_DIR}/jacoco && cp \"$f\" {REPORTS_DIR}/jacoco/$j.xml && "
              f"echo \"${{f%/target/site/jacoco/jacoco.xml}}/src/main/java\" > {REPORTS_DIR}/jacoco/$j.dir; done")
    collect = f"{_collect('*/target/surefire-reports/TEST-*.xml', 'surefire')}; {jacoco}"
    p.test_script = (f"{_expect('surefire')}{MVN}{level} -o -fae {JACOCO}:prepare-agent test 2>&1 | "
                     f"tee {REPORTS_DIR}/test-output.txt; "
                     f"rc=${{PIPESTATUS[0]}}; {MVN} -o -q {JACOCO}:report >/dev/null 2>&1; {collect}; exit $rc")


def gradle_version(root: Path) -> tuple[str, str] | None:
    """(version, why) of the Gradle the project asks for: its wrapper's distribution, else what its build scripts
    use that Debian's 4.4.1 lacks (the Kotlin DSL: 5.0; ``useJUnitPlatform``: 4.6); None when nothing says."""
    wrapper = root / "gradle" / "wrapper" / "gradle-wrapper.properties"
    if wrapper.is_file():
        m = re.search(r"distributionUrl=.*gradle-([\d.]+)(?:-\w+)*-(?:bin|all)\.zip",
                      wrapper.read_text(errors="replace"))
        if m:
            return m.group(1), f"its wrapper's distributionUrl names Gradle {m.group(1)}"
    if any(root.glob("*.gradle.kts")):
        return "5.0", "its build scripts use the Kotlin DSL (Gradle 5.0 on)"
    scripts = " ".join(f.read_text(errors="replace") for f in [*root.glob("*.gradle"), *root.glob("*/build.gradle")])
    if "useJUnitPlatform" in scripts:
        return "4.6", "its tests run on the JUnit Platform (useJUnitPlatform: Gradle 4.6 on)"
    return None


def _gradle(root: Path, p: Plan, ci: CiJobs) -> None:
    wanted = gradle_version(root)
    if wanted and _version(wanted[0]) > DEBIAN_GRADLE:
        raise ToolchainUnavailable(f"the project needs Gradle {wanted[0]} ({wanted[1]}); the only Gradle here is "
                                   "Debian's 4.4.1, and Gradle distributions cannot be fetched (services.gradle.org "
                                   "is no package registry kiln's builds reach)")
    p.packages = [*JDK, "gradle"]
    p.toolchain["java"] = "OpenJDK 17, Gradle 4.4.1 (Debian bookworm)"
    p.decide("gradle", "4.4.1", wanted[1] if wanted else "nothing asks for a newer Gradle than Debian's")
    p.env = {"GRADLE_USER_HOME": GRADLE_HOME}
    p.manifests = sorted({str(f.relative_to(root)) for pattern in ("*.gradle", "gradle.properties", "*/build.gradle",
                                                                   "*/*/build.gradle") for f in root.glob(pattern)})
    # Dependencies resolved with the build scripts alone where they allow it; the build resolves the rest.
    p.deps_script = (f"{_GRADLE_SETUP} && {{ {GRADLE} -q kilnResolve || echo 'kiln: the build scripts alone do not "
                     "resolve; the build resolves the dependencies'; }")
    p.build_script = f"{GRADLE} testClasses kilnResolve"
    p.decide("test command", "gradle test", "Gradle's test task, offline, every project (--continue), its JUnit XML "
                                           "read per test")
    p.test_script = (f"{_expect('gradle')}{GRADLE} --offline --continue test 2>&1 | tee {REPORTS_DIR}/test-output.txt; "
                     f"rc=${{PIPESTATUS[0]}}; {_collect('*/build/test-results/*/TEST-*.xml', 'gradle')}; exit $rc")


def _meson(root: Path, p: Plan, ci: CiJobs) -> None:
    p.packages = ["meson", "ninja-build"]
    p.toolchain["meson"] = "meson 1.0, ninja 1.11 (Debian bookworm)"
    _system_packages(root, p)
    p.lint_script = C_LINT
    p.build_script = "meson setup build --buildtype=debug -Db_coverage=true && meson compile -C build"
    p.decide("test command", "meson test", "meson project: meson test (it rebuilds first), its testlog.json read per "
                                           "test; gcov coverage (-Db_coverage)")
    p.test_script = (f": > {REPORTS_DIR}/meson-testlog.json; meson test -C build --print-errorlogs 2>&1 | "
                     f"tee {REPORTS_DIR}/test-output.txt; "
                     f"rc=${{PIPESTATUS[0]}}; cp build/meson-logs/testlog.json {REPORTS_DIR}/meson-testlog.json "
                     f"2>/dev/null; (cd build && {GCOV}); exit $rc")


RULE_FUNCTIONS = {"python": _python, "go": _go, "cargo": _cargo, "npm": _npm, "cmake": _cmake, "make": _make,
                  "autotools": _autotools, "meson": _meson, "maven": _maven, "gradle": _gradle}


def map_dockerfile(text: str, p: Plan) -> str:
    """The Dockerfile confined (``dockerfile.confine``: nothing dockerd does on the host's behalf reaches the host's
    network, another repository's image, root or kiln's labels), with every hub ``FROM`` replaced by the local image
    that can stand in for it."""

    def local_image(image: str) -> str:
        first = image.split("/")[0]
        if "/" in image and ("." in first or ":" in first or first == "localhost"):
            raise PlanError(f"Dockerfile FROM {image}: images from other registries cannot be pulled here")
        name = image.split(":")[0].split("@")[0].removeprefix("library/")
        local = LOCAL_BASES.get(name)
        if name == "debian" and not re.search(r":(bookworm|12)", image):
            local = None
        if local is None:
            raise PlanError(f"Dockerfile FROM {image}: no local image can stand in for it (local bases: Debian "
                            f"bookworm, and a toolchain with Go, Rust, Python 3.11, Node 20)")
        p.decide("base image", f"{image} -> kiln/{local}", "hub images cannot be pulled; local stand-in")
        return f"{LOCAL_IMAGE_MARK}{local}"

    confined = confine(text, local_image)
    for topic, choice, reason in confined.decisions:
        p.decide(topic, choice, reason)
    return confined.text
