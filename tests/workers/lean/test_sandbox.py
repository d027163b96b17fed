"""Lean input is untrusted code (``#eval`` runs IO): tried from inside the REPL, through the real worker, with the
fake REPL's test-only ``io`` command. With the sandbox (the default) every attempt fails, starting a program
included; the same attempts with the sandbox off succeed, which shows the probe itself works."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.streams.client import KilnClient
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.lean.client import LeanClient
from tests.workers.lean.conftest import lean_worker
from tests.workers.lean.fake import FAKE_REPL

SECRET = "s3-secret-of-the-worker"


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP service on every address of this machine (as the broker, S3 or the registry would be)."""
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        yield int(server.getsockname()[1])


def _outward_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))
        return str(s.getsockname()[0])


async def _attempt(settings: KilnSettings, tmp_path: Path, port: int, **env: str) -> dict[str, Any]:
    secret_file = tmp_path / "worker-secret.txt"
    secret_file.write_text(SECRET)
    with lean_worker(settings, 1, free_port(), KILN_S3_SECRET_KEY=SECRET, **env) as worker:
        worker.wait_assigned()
        spec = {"read": [str(secret_file), "/etc/shadow", f"/proc/{worker.proc.pid}/environ"],
                "connect": [f"127.0.0.1:{port}", f"{_outward_address()}:{port}", "127.0.0.1:9092",
                            "203.0.113.80:443"],
                "write": [str(FAKE_REPL.parent / "planted.py"), str(tmp_path / "planted.txt"), "/usr/planted"],
                "signal": [worker.proc.pid]}
        async with KilnClient(settings, "prover") as kiln:
            result = await LeanClient(kiln).run_code(f"-- fake: io {json.dumps(spec)}\ntheorem t : p := sorry")
    reports = [json.loads(m.data) for m in result.messages if m.severity == "info"]
    assert len(reports) == 1, result.messages
    report: dict[str, Any] = reports[0]
    return report


async def test_lean_input_cannot_reach_the_worker_its_secrets_or_the_network(
        stage_topics: Callable[..., KilnSettings], tmp_path: Path, listener: int) -> None:
    settings = stage_topics(("lean.requests", 1))
    report = await _attempt(settings, tmp_path, listener)
    assert report["uid"] == 65534  # as nobody, in the sandbox
    assert report["run"].startswith("PermissionError"), report["run"]  # and no program can be started from there
    assert not [name for name in report["env"] if name.startswith(("KILN_", "AWS_")) or "SECRET" in name]
    assert all(outcome != "ok" for outcome in report["read"].values()), report["read"]
    assert all(outcome != "ok" for outcome in report["connect"].values()), report["connect"]
    assert all(outcome != "ok" for outcome in report["write"].values()), report["write"]
    assert all("ProcessLookupError" in outcome for outcome in report["signal"].values()), report["signal"]
    assert not (FAKE_REPL.parent / "planted.py").exists() and not (tmp_path / "planted.txt").exists()


async def test_without_the_sandbox_the_same_input_reaches_everything(
        stage_topics: Callable[..., KilnSettings], tmp_path: Path, listener: int) -> None:
    settings = stage_topics(("lean.requests", 1))
    report = await _attempt(settings, tmp_path, listener, KILN_LEAN_SANDBOX="false")
    assert "KILN_S3_SECRET_KEY" in report["env"]
    assert report["run"].isdigit()  # `id -u` ran
    assert report["read"][str(tmp_path / "worker-secret.txt")] == "ok"
    assert report["connect"][f"127.0.0.1:{listener}"] == "ok"
    assert report["write"][str(tmp_path / "planted.txt")] == "ok"
    (FAKE_REPL.parent / "planted.py").unlink(missing_ok=True)
