"""The fallback when the rules cannot build a repository: a bounded repair loop that reads the README and the CI
configuration for commands, tries them in a container of the toolchain image, and iterates on the errors.

Without a model it is deterministic: commands come from the README's fenced shell blocks (``sh``, ``bash``,
``shell``; in ``console`` blocks and anywhere else only ``$ `` lines — prose and unlabelled blocks are never run) and
CI ``run:`` steps, minus CI-only plumbing (``$GITHUB_*`` writes, ``cargo miri``, toolchain installers, sudo),
classified as setup/build/test; on failure it applies small fixes (a script without its executable bit runs through
``sh``; a missing ``./`` is added), and it gives up after ``MAX_FAILED_TESTS`` failing test commands. With
``KILN_BUILD_AGENT_URL`` set, an OpenAI-compatible chat endpoint proposes each next command from the README, CI
file and the last error. Every command and where it came from is recorded; the image is the container committed
after the last build step.
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
from kiln.workers.builder.rules import ci_commands, readme_commands
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.common import sandbox as policy
from kiln.workers.common.containers import exec_capped, kill_on_cancel

_TEST = re.compile(r"\b(test|tests|check|pytest|ctest)\b")
_SETUP = re.compile(r"\b(install|configure|bootstrap|setup|apt-get|pip|npm ci)\b")
_SKIP = re.compile(r"^(git clone|cd \.\.|sudo |curl |wget |docker |rustup |brew |choco |apt-get |apt )|\$\{?GITHUB_|"
                   r"::(set-output|group|endgroup|add-mask)|\bcargo (\+\S+ )?miri\b|actions/|codecov|coveralls")
MAX_FAILED_TESTS = 3


@dataclass
class AgentPlan:
    setup: list[str] = field(default_factory=list)
    build: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)


def classify(root: Path) -> AgentPlan:
    plan = AgentPlan()
    seen: set[str] = set()
    for source, commands in (("README", readme_commands(root)), ("CI", ci_commands(root))):
        for command in commands:
            if command in seen or _SKIP.search(command):
                continue
            seen.add(command)
            phase = "test" if _TEST.search(command) else "setup" if _SETUP.search(command) else "build"
            getattr(plan, phase).append(command)
            plan.decisions.append(Decision(topic=f"agent {phase}", choice=command, reason=f"from {source}"))
    return plan


def repair(command: str, output: str, root: Path) -> str | None:
    """One deterministic fix for a failed command, or None."""
    first = command.split()[0] if command.split() else ""
    if "Permission denied" in output and (root / first.removeprefix("./")).is_file():
        return f"sh {command.removeprefix('./')}" if not command.startswith("sh ") else None
    if ("command not found" in output or "not found" in output) and (root / first).is_file() and "/" not in first:
        return f"./{command}"
    return None


@dataclass(frozen=True)
class AgentConfig:
    budget: int = 8
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


def run_loop(plan: AgentPlan, run: Runner, root: Path, budget: int,
             model: ModelClient | None = None) -> tuple[bool, str | None, list[Decision], str]:
    """Setup and build commands, then the first test command that passes. Returns (built, test command,
    decisions, last output). Each executed command costs one step of ``budget``."""
    decisions = list(plan.decisions)
    steps, output = 0, ""
    if model is None and not (plan.setup or plan.build or plan.test):
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
            if phase == "test" and code == 0:
                return True, command, decisions, output
        return gave_up("the model's commands did not reach a passing test command", output)
    for command in plan.setup + plan.build:
        while steps < budget:
            code, output = step(command)
            steps += 1
            if code == 0:
                break
            fixed = repair(command, output, root)
            if fixed is None:
                return gave_up(f"{command!r} failed and no repair applies", output)
            decisions.append(Decision(topic="agent repair", choice=fixed, reason=f"{command!r} failed: "
                                      f"{output.strip().splitlines()[-1][:200] if output.strip() else 'no output'}"))
            command = fixed
        else:
            return gave_up(f"the budget of {budget} commands ran out in setup and build", output)
    for failures, command in enumerate(plan.test):
        if steps >= budget or failures >= MAX_FAILED_TESTS:
            break
        code, output = step(command)
        steps += 1
        if code == 0:
            return True, command, decisions, output
        fixed = repair(command, output, root)
        if fixed is not None and steps < budget:
            code, output = step(fixed)
            steps += 1
            if code == 0:
                decisions.append(Decision(topic="agent repair", choice=fixed, reason=f"{command!r} failed"))
                return True, fixed, decisions, output
    return gave_up("no test command passed" if plan.test else "no README or CI command looks like a test command",
                   output)


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
                              limits=sandbox.limits(), egress=sandbox.network, working_dir="/work")
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
