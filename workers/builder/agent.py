"""The fallback when the rules cannot build a repository: a bounded repair loop that reads the README and the CI
configuration for commands, tries them in a container of the toolchain image, and iterates on the errors.

Without a model it is deterministic: commands come from the README's fenced shell blocks (``sh``, ``bash``,
``shell``; in ``console`` blocks and anywhere else only ``$ `` lines — prose and unlabelled blocks are never run) and
CI ``run:`` steps, minus CI-only plumbing (``$GITHUB_*`` writes, ``cargo miri``, toolchain installers, sudo),
classified as setup/build/test. They are tried as candidates, each one CI job or the README: CI's test jobs first,
then the README, then CI's other jobs, docs, lint and release jobs last; a candidate whose setup or build fails
gives way to the next, and the first test command whose output kiln can itemise (per-test results that agree with
the runner's summary, ``reports.unusable_reason``) is the image's test command. On failure it applies small fixes
(a script without its executable bit runs through ``sh``; a missing ``./`` is added; an npm/yarn or pip install
that fails on one dependency the registry lacks is run again without it when the tests do not use it), and a
candidate gives up after ``MAX_FAILED_TESTS`` failing test commands. With ``KILN_BUILD_AGENT_URL`` set, an
OpenAI-compatible chat endpoint proposes each next command from the README, CI file and the last error. Every
command and where it came from is recorded; the image is the container committed after the last build step.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kiln.schemas.builder import Decision
from kiln.schemas.images import REPORTS_DIR, ImageContract
from kiln.workers.builder.rules import NOT_THE_SUITE, THE_SUITE, ci_commands, ci_jobs, npm_test_tools, readme_commands
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.common import reports
from kiln.workers.common import sandbox as policy
from kiln.workers.common.containers import exec_capped, kill_on_cancel

_TEST = re.compile(r"\b(test|tests|check|pytest|ctest)\b")
_SETUP = re.compile(r"\b(install|configure|bootstrap|setup|apt-get|pip|npm ci)\b")
_SKIP = re.compile(r"^(git clone|cd \.\.|sudo |curl |wget |docker |rustup |brew |choco |apt-get |apt )|\$\{?GITHUB_|"
                   r"::(set-output|group|endgroup|add-mask)|\bcargo (\+\S+ )?miri\b|actions/|codecov|coveralls")
MAX_FAILED_TESTS = 3


@dataclass
class Candidate:
    """Commands to try together: one CI job's, or the README's."""

    source: str
    setup: list[str] = field(default_factory=list)
    build: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)


@dataclass
class AgentPlan:
    setup: list[str] = field(default_factory=list)
    build: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)  # in the order they are tried; none: the lists above

    def in_order(self) -> list[Candidate]:
        return self.candidates or [Candidate("commands", self.setup, self.build, self.test)]


def _job_rank(job: str) -> int:
    """0 for a CI job named like the test suite, 2 for docs, lint, release, benchmark jobs, 1 otherwise; the README
    ranks 1, after the test jobs."""
    name = job.split(":", 1)[-1]
    return 2 if NOT_THE_SUITE.search(name) else 0 if THE_SUITE.search(name) else 1


def classify(root: Path) -> AgentPlan:
    plan = AgentPlan()
    seen: set[str] = set()
    sources = [(1, "README", readme_commands(root))] + [(_job_rank(job), f"CI job {job}", commands)
                                                         for job, commands in ci_jobs(root)]
    for _rank, source, commands in sorted(sources, key=lambda s: s[0]):  # stable: file order among equals
        candidate = Candidate(source)
        for command in commands:
            if _SKIP.search(command):
                continue
            phase = "test" if _TEST.search(command) else "setup" if _SETUP.search(command) else "build"
            getattr(candidate, phase).append(command)
            if command not in seen:
                getattr(plan, phase).append(command)
                plan.decisions.append(Decision(topic=f"agent {phase}", choice=command, reason=f"from {source}"))
            seen.add(command)
        if candidate.setup or candidate.build or candidate.test:
            plan.candidates.append(candidate)
    return plan


# What npm/yarn and pip print when the registry lacks a package (or the version asked for).
_NPM_MISSING = re.compile(r"(?:No matching version found for |\b404\s+'|Couldn't find package \")"
                          r"(@?[\w.-]+(?:/[\w.-]+)?)@|GET https?://\S+?/(@?[\w.%-]+) - Not found")
_PIP_MISSING = re.compile(r"(?:No matching distribution found for|Could not find a version that satisfies the "
                          r"requirement) ([A-Za-z0-9][\w.-]*)")


def _without_missing_dependency(command: str, output: str, root: Path) -> tuple[str, str] | None:
    """(the install again without the one dependency the registry lacks, that dependency) when the tests do not use
    it: an npm/yarn dev dependency neither the test script nor the test files name, a pip requirement of a
    ``-r`` file no test module imports."""
    npm = re.search(r"\b(npm (?:ci|install|i)|yarn(?: install)?)\b", command)
    missing = _NPM_MISSING.search(output)
    if npm and missing and (root / "package.json").is_file():
        name = (missing.group(1) or missing.group(2)).replace("%2f", "/").replace("%2F", "/")
        try:
            pkg = json.loads((root / "package.json").read_text())
        except ValueError:
            return None
        used = npm_test_tools(root, pkg) or set()
        if name not in pkg.get("devDependencies", {}) or name in used:
            return None
        drop = ("node -e 'const fs=require(\"fs\"),p=JSON.parse(fs.readFileSync(\"package.json\"));delete "
                f"p.devDependencies[{json.dumps(name)}];fs.writeFileSync(\"package.json\",JSON.stringify(p))'")
        again = "yarn install" if npm.group(1).startswith("yarn") else \
            "rm -f package-lock.json && npm install --no-audit --no-fund"
        return f"{drop} && {again}", name
    requirement = re.search(r"\bpip3? install\b.*?(?:-r|--requirement)[= ]?(\S+)", command)
    missing = _PIP_MISSING.search(output)
    if requirement and missing and (root / requirement.group(1)).is_file():
        name = missing.group(1)
        module = re.escape(name.lower().replace("-", "_"))
        tests = [f for d in ("tests", "test") if (root / d).is_dir() for f in (root / d).rglob("*.py")]
        if any(re.search(rf"^\s*(?:import|from)\s+{module}\b", f.read_text(errors="replace"), re.MULTILINE | re.I)
               for f in tests[:500]):
            return None
        kept = f"/tmp/kiln-{Path(requirement.group(1)).name}"
        filtered = (f"grep -viE '^{re.escape(name)}([^A-Za-z0-9_.-]|$)' {requirement.group(1)} > {kept}; "
                    f"{command.replace(requirement.group(1), kept, 1)}")
        return filtered, name
    return None


def repair(command: str, output: str, root: Path) -> str | None:
    """One deterministic fix for a failed command, or None."""
    first = command.split()[0] if command.split() else ""
    if "Permission denied" in output and (root / first.removeprefix("./")).is_file():
        return f"sh {command.removeprefix('./')}" if not command.startswith("sh ") else None
    if ("command not found" in output or "not found" in output) and (root / first).is_file() and "/" not in first:
        return f"./{command}"
    without = _without_missing_dependency(command, output, root)
    return without[0] if without else None


@dataclass(frozen=True)
class AgentConfig:
    budget: int = 16
    model: ModelClient | None = None


@dataclass
class ModelClient:
    """Any OpenAI-compatible ``/v1/chat/completions`` endpoint."""

    url: str
    model: str
    api_key: str = ""

    def next_command(self, context: str) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        response = httpx.post(f"{self.url.rstrip('/')}/v1/chat/completions", headers=headers, timeout=120, json={
            "model": self.model, "temperature": 0,
            "messages": [{"role": "system", "content": "You build software repositories in a Debian container with "
                          "Go, Rust, Python and Node. Reply with JSON only: {\"phase\": \"setup|build|test|done\", "
                          "\"command\": \"<one shell command>\"}."},
                         {"role": "user", "content": context}]})
        response.raise_for_status()
        content = response.json()["choices"][0]["message"]["content"]
        match = re.search(r"\{.*\}", content, re.DOTALL)
        return json.loads(match.group(0)) if match else {"phase": "done", "command": ""}


Runner = Callable[[str], tuple[int, str]]


def itemises(code: int, output: str) -> bool:
    """Whether a test command's output gives per-test results kiln trusts (as the image's test runs will be read)."""
    report = reports.parse_results("agent", code, {"test-output.txt": output.encode()})
    return report is not None and reports.unusable_reason(report) is None


def run_loop(plan: AgentPlan, run: Runner, root: Path, budget: int,
             model: ModelClient | None = None) -> tuple[bool, str | None, list[Decision], str]:
    """Each candidate's setup and build commands, then its test commands, until one test command's output itemises
    (``itemises``). Returns (built, test command, decisions, last output). Each executed command costs one step of
    ``budget``; a command that already succeeded for an earlier candidate is not run again."""
    decisions = list(plan.decisions)
    steps, output = 0, ""
    if model is None and not any(c.setup or c.build or c.test for c in plan.in_order()):
        return False, None, decisions, "the agent found no command to try: no shell block in the README, no CI step"
    tried: list[str] = []

    def step(command: str) -> tuple[int, str]:
        code, out = run(command)
        tried.append(f"$ {command}  (exit {code})")
        return code, out

    def gave_up(why: str, last: str) -> tuple[bool, str | None, list[Decision], str]:
        return False, None, decisions, f"agent: {why}; tried:\n" + "\n".join(tried) + f"\n--- last output:\n{last}"

    if model is not None:
        readme = "\n".join(readme_commands(root))
        history: list[str] = []
        while steps < budget:
            proposal = model.next_command(f"README and CI commands:\n{readme}\n{ci_commands(root)}\n"
                                          f"History:\n{chr(10).join(history)}\nLast output:\n{output[-3000:]}")
            phase, command = proposal.get("phase", "done"), proposal.get("command", "")
            if phase == "done" or not command:
                break
            code, output = step(command)
            steps += 1
            decisions.append(Decision(topic=f"agent {phase}", choice=command, reason=f"model, exit {code}"))
            history.append(f"$ {command}  (exit {code})")
            if phase == "test" and itemises(code, output):
                return True, command, decisions, output
        return gave_up("the model's commands did not reach a test command whose results kiln can read", output)
    succeeded: set[str] = set()
    why = "no README or CI command looks like a test command"
    for candidate in plan.in_order():
        if steps >= budget:
            break
        ready = True
        for command in candidate.setup + candidate.build:
            if command in succeeded:
                continue
            while steps < budget:
                code, output = step(command)
                steps += 1
                if code == 0:
                    succeeded.add(command)
                    break
                fixed = repair(command, output, root)
                if fixed is None:
                    why, ready = f"{command!r} ({candidate.source}) failed and no repair applies", False
                    break
                last = output.strip().splitlines()[-1][:200] if output.strip() else "no output"
                decisions.append(Decision(topic="agent repair", choice=fixed, reason=f"{command!r} failed: {last}"))
                command = fixed
            else:
                return gave_up(f"the budget of {budget} commands ran out in setup and build", output)
            if not ready:
                break
        if not ready:
            continue
        for failures, command in enumerate(candidate.test):
            if steps >= budget or failures >= MAX_FAILED_TESTS:
                break
            code, output = step(command)
            steps += 1
            if itemises(code, output):
                decisions.append(Decision(topic="agent test", choice=command, reason=f"from {candidate.source}: "
                                          "its output gives per-test results kiln can read"))
                return True, command, decisions, output
            fixed = repair(command, output, root)
            if fixed is not None and steps < budget:
                code, output = step(fixed)
                steps += 1
                if itemises(code, output):
                    decisions.append(Decision(topic="agent repair", choice=fixed, reason=f"{command!r} failed"))
                    return True, fixed, decisions, output
        if candidate.test:
            why = "no test command gave per-test results kiln can read"
    return gave_up(why, output)


def test_command(test: str) -> str:
    """The agent's test command as an image runs it: its output kept in the reports directory, where the per-test
    lines and the runner's summary are read from (no reporter of kiln's choosing is known for it)."""
    return (f"mkdir -p {REPORTS_DIR} && cd /work && {{ {test}\n}} 2>&1 | tee {REPORTS_DIR}/test-output.txt; "
            "exit ${PIPESTATUS[0]}")


def agent_image(client: Any, toolchain: str, checkout: Path, tag: str, labels: dict[str, str], budget: int,
                model: ModelClient | None, timeout_s: float) -> tuple[bool, str | None, list[Decision], str]:
    """Run the loop in a container of the build sandbox (the checkout in /work; root with a minimal capability set, as
    the agent's commands install system packages); on success commit it as ``tag``."""
    sandbox = BuildSandbox()
    container = policy.create(client, toolchain, ["sleep", "infinity"], profile=policy.BUILD_AGENT,
                              limits=sandbox.limits(), egress=sandbox.network, working_dir="/work",
                              cgroup_parent=sandbox.worker_cgroup())
    kill_on_cancel(container)
    try:
        container.start()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(checkout, arcname="work")
        container.put_archive("/", buffer.getvalue())

        def run(command: str) -> tuple[int, str]:
            # The proxy reaches the commands only (never the committed image: tests run without network).
            return exec_capped(container, ["timeout", "-s", "KILL", f"{timeout_s:g}", "bash", "-c", command],
                               sandbox.log_bytes, workdir="/work", environment=sandbox.proxy_env())

        plan = classify(checkout)
        built, test, decisions, output = run_loop(plan, run, checkout, budget, model)
        if built and test is not None:
            run("chown -R 1000:1000 /work")
            contract = ImageContract(system="agent", test=test_command(test))
            container.commit(repository=tag.rsplit(":", 1)[0], tag=tag.rsplit(":", 1)[1],
                             conf={"Labels": {**labels, **contract.to_labels()},
                                   "Cmd": ["bash"], "WorkingDir": "/work"})
        return built, test, decisions, output
    finally:
        container.remove(force=True)
