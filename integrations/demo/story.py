"""``kiln demo``: kiln's real job in miniature, on this machine, with live progress.

A small repository shipped with kiln (``calc-repo/``: a calculator whose ``mul`` adds) is ingested into Saucer,
built into an image by the builder's rules, and its tests run in an exec session; a batch of candidate patches is
scored by those tests through the verify stage (the rewards); a Lean snippet is proved on the Lean stage (with the
fake REPL, ``tests/fakes/lean_repl.py``: Lean cannot be installed here, and the output says so); and a short learning
run (``LearningRun``: an inference server, rollout workers, a trainer and an actor, each its own process) shows a
tiny model's held-out accuracy rising on the rollout stage's rewards, with its report picture written where the
demo says. Every stage runs as a real ``kiln worker`` process on the real broker and Docker; the demo talks to them
through their client facades, like any trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console
from rich.table import Table

from kiln.schemas.builder import BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.schemas.rl import RolloutTask
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.errors import InfraError
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.builder.client import BuilderClient
from kiln.workers.exec.client import ExecClient
from kiln.workers.ingest.client import SaucerClient
from kiln.workers.lean.client import LeanClient
from kiln.workers.verify.client import VerifyClient

REPOSITORY = Path(__file__).resolve().parent / "calc-repo"
FAKE_REPL = Path(__file__).resolve().parents[2] / "tests" / "fakes" / "lean_repl.py"
"""The fake Lean REPL: in a checkout only (a wheel carries no tests); without it the Lean step is skipped."""
NAME = "demo/calc"
THEOREM = "theorem demo : p \u2192 p \u2227 True := by sorry"
TACTICS = ["intro h", "constructor", "exact h", "trivial", "left", "right"]


class DemoSettings(BaseSettings):
    """``KILN_DEMO_*``: how long the learning run may take."""

    model_config = SettingsConfigDict(env_prefix="KILN_DEMO_", extra="ignore")

    steps: int = Field(150, ge=1, description="Trainer steps at most (64 groups of 8 samples each).")
    target: float = Field(0.3, gt=0, le=1, description="Stop learning once held-out greedy accuracy reaches it.")
    deadline_s: float = Field(150.0, gt=0, description="Stop learning after this long, reached or not.")


@dataclass(frozen=True)
class Candidate:
    label: str
    path: str
    source: str


BUGGY = (REPOSITORY / "calc" / "__init__.py").read_text()
MUL = "def mul(a: int, b: int) -> int:\n"
CANDIDATES = [
    Candidate("multiplies", "calc/__init__.py", BUGGY.replace(f"{MUL}    return a + b", f"{MUL}    return a * b")),
    Candidate("special-cases 2 x 3", "calc/__init__.py", BUGGY.replace(
        f"{MUL}    return a + b", f"{MUL}    if (a, b) == (2, 3):\n        return 6\n    return a + b")),
    Candidate("changes nothing that matters", "README.md", "# calc\n\nA calculator.\n"),
    Candidate("deletes the failing tests", "tests/test_calc.py",
              "from calc import add\n\n\ndef test_add() -> None:\n    assert add(2, 3) == 5\n"),
]


class Story:
    """The demo's steps, each printed as it starts and as it ends."""

    def __init__(self, settings: KilnSettings, demo: DemoSettings, console: Console) -> None:
        self.demo = demo
        self.console = console
        self.work = settings.cache / "demo"
        self.settings = settings.model_copy(update={"topic_prefix": f"{settings.topic_prefix}demo."})
        self.workers: list[WorkerProcess] = []

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[None]:
        started = time.monotonic()
        with self.console.status(f"[bold]{title}[/] …"):
            yield
        self.console.print(f"[green]✓[/] [bold]{title}[/] [dim]({time.monotonic() - started:.1f} s)[/]")

    def say(self, text: str) -> None:
        self.console.print(f"    {text}", highlight=False)

    async def run(self) -> Path:
        self.work.mkdir(parents=True, exist_ok=True)
        admin.create_topics(self.settings)
        try:
            with self.step("workers: ingest, build, exec, verify, lean — each a `kiln worker` process"):
                await self._start_workers()
            self.say(f"their logs: {self.workers[0].log.parent}/kiln-worker-*.log")
            checkout = self._checkout()
            async with KilnClient(self.settings, client_id="kiln-demo") as kiln:
                image = await self._repository_to_image(kiln, checkout)
                await self._tests_in_a_session(kiln, image)
                await self._rewards(kiln, image, checkout)
                await self._lean(kiln)
        finally:
            WorkerProcess.stop_all(self.workers, 30)
        return await self._learning()

    async def _start_workers(self) -> None:
        env = {"KILN_TOPIC_PREFIX": self.settings.topic_prefix, "KILN_CACHE": str(self.settings.cache),
               "KILN_INGEST_LOCAL_ROOTS": json.dumps([str(self.work)]),
               "KILN_EXEC_LOCK_DIR": str(self.work / "exec-locks"), "KILN_EXEC_WARM": "1"}
        stages = [("ingest", "repo.ingest", 1), ("build", "image.build", 1), ("exec", "exec.requests", 4),
                  ("verify", "verify.requests", 4)]
        if FAKE_REPL.exists():
            env["KILN_LEAN_REPL"] = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_REPL))}"
            stages.append(("lean", "lean.requests", 2))
        for stage, topic, slots in stages:
            self.workers.append(WorkerProcess(stage, self.settings, topic, slots=slots, grace_s=5,
                                              group=f"kiln-demo.{stage}",
                                              env={**env, "KILN_METRICS_PORT": str(free_port())}))
        await asyncio.gather(*(asyncio.to_thread(w.wait_assigned, 120) for w in self.workers))

    def _checkout(self) -> Path:
        """The shipped repository as a git repository with one deterministic commit (same content, same id)."""
        path = self.work / "calc"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(REPOSITORY, path)
        fixed = {"GIT_AUTHOR_NAME": "kiln demo", "GIT_AUTHOR_EMAIL": "demo@kiln.invalid",
                 "GIT_COMMITTER_NAME": "kiln demo", "GIT_COMMITTER_EMAIL": "demo@kiln.invalid",
                 "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z",
                 "PATH": "/usr/bin:/bin"}
        for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "calc: mul adds"]):
            subprocess.run(["git", *args], cwd=path, env=fixed, check=True, capture_output=True)
        return path

    def _patch(self, checkout: Path, candidate: Candidate) -> str:
        """The candidate as a unified diff against the committed revision."""
        target = checkout / candidate.path
        original = target.read_text()
        target.write_text(candidate.source)
        try:
            return subprocess.run(["git", "diff"], cwd=checkout, capture_output=True, text=True, check=True).stdout
        finally:
            target.write_text(original)

    async def _repository_to_image(self, kiln: KilnClient, checkout: Path) -> str:
        with self.step(f"repository → Saucer: `{NAME}` from {checkout}"):
            ingested = await SaucerClient(kiln).ingest_repository(IngestRequest(name=NAME, location=str(checkout)))
        if ingested.status != "ingested":
            raise InfraError(f"ingesting {NAME} failed: {ingested.status}")
        self.say(f"stored: {ingested.commits} commit, {ingested.objects} objects, refs {sorted(ingested.refs)}; "
                 f"manifest {ingested.manifest and ingested.manifest[:19]}…")
        with self.step("revision → image: the builder's rules pick the build system, build, run the tests"):
            built = await BuilderClient(kiln).build(BuildRequest(repository=NAME))
        if not built.usable or built.image is None or built.tests is None:
            raise InfraError(f"building {NAME} failed: {built.failure}: {built.detail}")
        coverage = built.tests.coverage
        cached = ", from the build cache" if built.cached else ""
        self.say(f"image {built.image} ({built.system}, {built.recipe}{cached})"
                 f"; tests {built.tests.passed} passed, {built.tests.failed} failed"
                 + (f"; coverage {coverage.lines_covered}/{coverage.lines_total} lines" if coverage else ""))
        return built.image

    async def _tests_in_a_session(self, kiln: KilnClient, image: str) -> None:
        execs = ExecClient(kiln)
        with self.step("tests in an exec session: no network, read-only image, uid 1000"):
            session = await execs.open_session(image, repository=NAME)
            try:
                ran = await execs.run_tests(session)
            finally:
                await execs.close_session(session)
        report = ran.tests
        if report is None:
            raise InfraError("the session's test run gave no report")
        outcomes = ", ".join(f"{c.name} {c.outcome}" for c in report.cases)
        self.say(f"{report.passed} passed, {report.failed} failed: {outcomes}")

    async def _rewards(self, kiln: KilnClient, image: str, checkout: Path) -> None:
        patches = [self._patch(checkout, c) for c in CANDIDATES]
        task = RolloutTask(task_id="calc-mul", prompt="Fix calc.mul.", verifier="tests", check={"image": image})
        with self.step(f"{len(patches)} candidate patches → rewards: each applied to the image, its tests run "
                       "(verify stage → exec)"):
            verdicts = await VerifyClient(kiln).verify(task, patches)
        table = Table("candidate patch", "tests passed / failed", "reward", "why", box=None, padding=(0, 2))
        for candidate, verdict in zip(CANDIDATES, verdicts, strict=True):
            counts = f"{verdict.passed} / {verdict.failed}" if verdict.passed is not None else "not run"
            why = verdict.reason or str(verdict.details.get("stage", "")) or "share of tests passing"
            table.add_row(candidate.label, counts, f"{verdict.reward:.2f}", why[:60])
        self.console.print(table)

    async def _lean(self, kiln: KilnClient) -> None:
        if not FAKE_REPL.exists():
            self.say("[yellow]Lean skipped[/]: no Lean here and no fake REPL (it ships with a checkout's tests)")
            return
        lean = LeanClient(kiln)
        with self.step("Lean: a proof found by search on the Lean stage — [yellow]the FAKE REPL[/] "
                       "(tests/fakes/lean_repl.py, Lean's protocol over a toy calculus: Lean is not installed here)"):
            code = await lean.run_code(THEOREM)
            outcome = await lean.explore(code.sorries[0].state, TACTICS)
        self.say(f"{THEOREM.removesuffix(' := by sorry')} := by {'; '.join(outcome.proof or ['(none found)'])}  "
                 f"[dim]({outcome.expanded} states tried)[/]")

    async def _learning(self) -> Path:
        """``kiln rl learn`` as a process of its own, its evaluations shown as they are measured."""
        d = self.demo
        picture = self.work / "rl-report.png"
        shutil.rmtree(self.work / "learning", ignore_errors=True)  # each run its own logs and checkpoints
        self.console.print("[bold]learning[/]: a 0.1M-parameter model learns 1-digit addition from the rollout "
                           "stage's rewards (`kiln rl learn`: server, 2 rollout workers, trainer, actor, one process "
                           f"each); held-out greedy accuracy every 10 s, until {d.target} or {d.deadline_s:.0f} s")
        learn = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "kiln"), "rl", "learn", "--out", str(picture), "--steps", str(d.steps),
            "--target", str(d.target), "--deadline-s", str(d.deadline_s), "--workdir", str(self.work / "learning"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        assert learn.stdout is not None
        said = []
        with self.console.status("[bold]learning[/] …"):
            async for raw in learn.stdout:
                said.append(line := raw.decode(errors="replace").rstrip())
                if "greedy accuracy" in line:
                    self.say(line)
        if await learn.wait() != 0 or not picture.exists():
            raise InfraError("the learning run failed:\n" + "\n".join(said[-20:]))
        summary = next(line for line in reversed(said) if line.startswith("held-out accuracy"))
        self.console.print(f"[green]✓[/] [bold]learning[/]: {summary.replace(' -> ', ' → ')}", highlight=False)
        return picture


async def tell(settings: KilnSettings, console: Console) -> Path:
    """The whole story; returns the report picture's path."""
    return await Story(settings, DemoSettings(), console).run()
