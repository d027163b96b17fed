"""The gateway as it runs in production: ``kiln gateway serve`` in its own process in front of real exec and Lean
worker processes, on topics under a test-unique prefix."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from tests.stages import worker_env
from tests.workers.exec.conftest import exec_worker
from tests.workers.lean.conftest import lean_worker

Gateway = Callable[..., str]


@contextlib.contextmanager
def gateway_process(settings: KilnSettings, log: Path, **env: str) -> Iterator[str]:
    """``kiln gateway serve`` on a free loopback port; yields its URL once /health answers."""
    port = free_port()
    proc_env = {**os.environ, "KILN_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
                "KILN_BLOB_STORE": f"file://{settings.cache / 'blobs'}", **worker_env(settings), **env}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kiln.streams.cli", "gateway", "serve", "--port", str(port)],
                                env=proc_env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited {proc.returncode}: {log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not answer: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def gateway(stage_topics: Callable[..., KilnSettings], tmp_path: Path) -> Iterator[Gateway]:
    """``gateway(exec=True, lean=False, **env)``: the gateway URL, with the stages it needs running."""
    with contextlib.ExitStack() as stack:
        def start(exec: bool = True, lean: bool = False, **env: str) -> str:
            settings = stage_topics(*([("exec.requests", 2)] if exec else []),
                                    *([("lean.requests", 2)] if lean else []))
            workers: list[WorkerProcess] = []
            if exec:
                workers.append(stack.enter_context(exec_worker(settings, tmp_path / "locks")))
            if lean:
                workers.append(stack.enter_context(lean_worker(settings, 2, free_port())))
            for worker in workers:
                worker.wait_assigned()
            return stack.enter_context(gateway_process(settings, tmp_path / "gateway.log", **env))
        yield start


def _python_312() -> str | None:
    """A working Python >= 3.12: pyenv's installs first (its shims depend on the directory they run from)."""
    candidates = sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python3"), reverse=True)
    for python in [*map(str, candidates), shutil.which("python3.13"), shutil.which("python3.12")]:
        if python and subprocess.run([python, "-c", "import sys; assert sys.version_info >= (3, 12)"],
                                     capture_output=True).returncode == 0:
            return python
    return None


@pytest.fixture(scope="session")
def kimina_python(kafka: KilnSettings) -> Path:
    """A Python >= 3.12 interpreter with ``kimina-client`` installed, unmodified: its models use ``typing.TypedDict``,
    which pydantic rejects below 3.12, so it cannot share kiln's 3.11 environment. Built once, cached by version."""
    # pygments and tqdm: imported by the client but missing from its declared dependencies.
    requirement = "kimina-client==0.2.1 pygments tqdm"
    python = _python_312()
    if python is None:
        pytest.skip("kimina-client needs Python >= 3.12 and none is installed")
    env_dir = kafka.cache / f"peer-kimina-{hashlib.sha256(requirement.encode()).hexdigest()[:12]}"
    if not (env_dir / ".complete").exists():
        shutil.rmtree(env_dir, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(env_dir)], check=True)
        subprocess.run([str(env_dir / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                        *requirement.split()], check=True)
        (env_dir / ".complete").touch()
    return env_dir / "bin" / "python"
