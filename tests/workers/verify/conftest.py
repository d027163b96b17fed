"""Verify tests run a real exec worker and a real verify worker on per-test topics; checkers run in exec sandboxes on
kiln's toolchain image."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.schemas.exec import ExecRequest
from kiln.schemas.rl import RolloutTask
from kiln.streams.codec import decode_request, request_payload
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from tests.stages import worker_env
from tests.streams.harness import read_all
from tests.workers.exec.conftest import exec_worker

IMAGE = "kiln/toolchain:latest"
# One verdict per completion: the completion, stripped, is the group's answer.
CHECKER = """\
import json
for line in open("groups.jsonl"):
    group = json.loads(line)
    print(json.dumps({"verdicts": [{"reward": 1.0 if c.strip() == group["answer"] else 0.0, "said": c.strip()}
                                   for c in group["completions"]]}))
"""


def check(**overrides: Any) -> dict[str, Any]:
    return {"image": IMAGE, "command": "python3 -I check.py", "files": {"check.py": CHECKER}, "timeout_s": 30,
            **overrides}


def task(answer: str = "7", **overrides: Any) -> RolloutTask:
    """``3+4=``, checked by ``CHECKER`` in an exec sandbox; ``check`` overrides (e.g. a ``sleep`` past its time)."""
    return RolloutTask(task_id=f"add-{answer}", prompt="3+4=", answer=answer, verifier="exec",
                       check=check(**overrides))


def timing_out() -> RolloutTask:
    """A checker that runs past its 1 s: every completion's verdict is a ``timeout`` failure."""
    return task(command="sleep 30", timeout_s=1)


def call_sizes(settings: KilnSettings, calls: int) -> list[int]:
    """Groups per exec call (an exec checker's batch), by the ``groups.jsonl`` each call on ``exec.requests``
    carried, once it holds at least ``calls``."""
    sizes = []
    for record in read_all(settings, settings.topic("exec.requests"), expect=calls):
        request = ExecRequest.model_validate(request_payload(decode_request(record.value()), ExecRequest, None))
        groups = next(f.text for f in request.files if f.path.endswith("groups.jsonl"))
        sizes.append(len((groups or "").splitlines()))
    return sorted(sizes)


def verify_worker(settings: KilnSettings, slots: int = 8, **env: str) -> WorkerProcess:
    return WorkerProcess("verify", settings, "verify.requests", slots=slots, grace_s=5,
                         env=worker_env(settings, KILN_METRICS_PORT=str(free_port()), **env))


@pytest.fixture
def verify_settings(stage_topics: Callable[..., KilnSettings]) -> KilnSettings:
    return stage_topics(("exec.requests", 4), ("verify.requests", 4))


@pytest.fixture
def stack(verify_settings: KilnSettings, docker_engine: Any, tmp_path: Path) -> Iterator[KilnSettings]:
    """An exec worker and a verify worker, both assigned: settings for clients."""
    with exec_worker(verify_settings, tmp_path / "locks") as ex, verify_worker(verify_settings) as ver:
        ex.wait_assigned()
        ver.wait_assigned()
        yield verify_settings
