"""Drives the ``infra/`` scripts (Kafka, Docker, S3, registry) from Python with rich progress.

The scripts are the single source of truth for how a component is installed and started; this module only runs
them, shows progress, and reports a timing line per step so slow steps are visible in CI logs.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kiln.streams.errors import InfraError

console = Console(stderr=True)


def infra_dir() -> Path:
    """``infra/`` of the checkout kiln is installed from (editable install), or ``KILN_INFRA_DIR``."""
    override = os.environ.get("KILN_INFRA_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[1] / "infra"
    if not (path / "lib.sh").is_file():
        raise InfraError(f"infra scripts not found at {path}; set KILN_INFRA_DIR to the checkout's infra/")
    return path


@dataclass(frozen=True)
class Step:
    name: str
    script: str
    args: tuple[str, ...]


COMPONENT_STEPS: dict[str, list[Step]] = {
    "kafka": [Step("kafka: resolve jars", "kafka/kafka.sh", ("install",)),
              Step("kafka: start broker", "kafka/kafka.sh", ("start",))],
    "docker": [Step("docker: engine", "docker/docker.sh", ("engine",)),
               Step("docker: base image", "docker/docker.sh", ("base",)),
               Step("docker: toolchain image", "docker/docker.sh", ("toolchain",)),
               Step("docker: build egress proxy", "egress/egress.sh", ("start",))],
    "s3": [Step("s3: build versitygw", "s3/s3.sh", ("install",)),
           Step("s3: start", "s3/s3.sh", ("start",))],
    "registry": [Step("registry: start on s3", "registry/registry.sh", ("start",))],
    "lean": [Step("lean: REPL sandbox (bubblewrap)", "lean/sandbox.sh", ("install",))],
    "ops": [Step("ops: promtool, headless chromium", "ops/ops.sh", ("install",))],
    "compose": [Step("compose: Docker Compose v2", "compose/compose.sh", ("install",)),
                Step("compose: the stack's local images", "compose/compose.sh", ("images",))],
    "trainers": [Step("trainers: verl, AReaL, OpenRLHF, verifiers (the adapters' tests)", "trainers/trainers.sh",
                      ("install",))],
}


def run_script(script: str, *args: str, timeout: float = 3600.0) -> str:
    """Run one infra script quietly; returns its stdout, raises InfraError with its output on failure."""
    proc = subprocess.run(
        ["bash", str(infra_dir() / script), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise InfraError(f"{script} {' '.join(args)} failed:\n{proc.stderr[-4000:]}{proc.stdout[-2000:]}")
    return proc.stdout


@contextmanager
def _one_at_a_time(step: Step) -> Iterator[None]:
    """Checkouts set up side by side on one machine (a CI clone beside a developer's) run each step one at a time:
    the second waits, then finds the work done (every step is idempotent) instead of racing the first's build."""
    cache = Path(os.environ.get("KILN_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln")
    cache.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9]+", "-", " ".join((step.script, *step.args))).strip("-")
    with open(cache / f"setup-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_steps(steps: Sequence[Step]) -> list[tuple[str, float]]:
    """Run steps in order under a progress display; print ``[timing]`` lines; stop at the first failure. Each step
    holds a machine-wide lock of its own while it runs (``_one_at_a_time``)."""
    timings: list[tuple[str, float]] = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        for step in steps:
            task = progress.add_task(step.name, total=None)
            started = time.monotonic()
            tail: deque[str] = deque(maxlen=40)
            with _one_at_a_time(step):  # the lock's descriptor is not inherited (close_fds): daemons never hold it
                proc = subprocess.Popen(
                    ["bash", str(infra_dir() / step.script), *step.args],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )
                assert proc.stdout is not None
                for line in proc.stdout:
                    tail.append(line.rstrip())
                    progress.update(task, description=f"{step.name} [dim]{line.strip()[:80]}[/]")
                rc = proc.wait()
            elapsed = time.monotonic() - started
            timings.append((step.name, elapsed))
            progress.update(task, total=1, completed=1,
                            description=f"{step.name} {'[green]ok' if rc == 0 else '[red]failed'}")
            console.print(f"[timing] {step.name}: {elapsed:.1f}s", markup=False, highlight=False)
            if rc != 0:
                raise InfraError(f"{step.name} failed (exit {rc}):\n" + "\n".join(tail))
    return timings
