"""One sandbox policy (workers/common/sandbox.py): it is the only caller of the engine's ``containers.create`` and
``containers.run`` in kiln's source, and every container the sandboxing code creates -- an exec session, a
run_once runner, the builder's test run, a build step on the egress network, the repair agent's container --
has, as the engine reports it (``docker inspect``), exactly what its profile states."""

from __future__ import annotations

import ast
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from kiln.ingest.reader import Repository
from kiln.schemas.exec import SessionLimits
from kiln.workers.builder import layers
from kiln.workers.builder.agent import agent_image
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.common import sandbox
from kiln.workers.common.containers import run_sandboxed
from kiln.workers.exec.runners import RunnerPool, runner_key, supervisor_binary
from kiln.workers.exec.sessions import SessionManager

ROOT = Path(__file__).resolve().parents[3]
TOPS = ("streams", "workers", "ingest", "rl", "integrations", "schemas")
POLICY = "workers/common/sandbox.py"


def engine_creates(source: str) -> list[int]:
    """Lines of ``source`` that call ``<anything>.containers.create(`` or ``<anything>.containers.run(``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("create", "run") and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "containers"):
            lines.append(node.lineno)
    return lines


def test_only_the_policy_module_asks_the_engine_for_a_container() -> None:
    checked, callers = 0, []
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            lines = engine_creates(path.read_text())
            checked += 1
            if relative != POLICY:
                callers += [f"{relative}:{line}" for line in lines]
    assert checked > 100
    assert callers == []
    assert len(engine_creates((ROOT / POLICY).read_text())) == 2  # the policy's own create and run


def test_the_check_finds_a_caller_elsewhere() -> None:
    rogue = ("import docker\n\nclient = docker.from_env()\n"
             "client.containers.run('kiln/base', ['id'], privileged=True)\n"
             "def make(self):\n    return self.client.containers.create(image, ['true'])\n"
             "client.containers.list(all=True)\nclient.images.create('x')\n")
    assert engine_creates(rogue) == [4, 6]


def test_a_container_off_policy_is_reported() -> None:
    strict = {"Name": "/x", "Config": {"User": "1000:1000", "Labels": {sandbox.PROFILE_LABEL: "test-run"}},
              "HostConfig": {"NetworkMode": "none", "CapDrop": ["ALL"], "CapAdd": None, "Privileged": False,
                             "SecurityOpt": ["no-new-privileges"], "ReadonlyRootfs": False, "Init": True,
                             "Memory": 1 << 30, "MemorySwap": 1 << 30, "NanoCpus": 10**9, "PidsLimit": 64,
                             "ShmSize": 64 << 20}}
    assert sandbox.violations(strict, "kiln-egress") == []
    loose = {**strict, "HostConfig": {**strict["HostConfig"], "NetworkMode": "bridge", "CapAdd": ["NET_RAW"]}}
    assert len(sandbox.violations(loose, "kiln-egress")) == 2
    assert "not created by the sandbox policy" in sandbox.violations({**strict, "Config": {}}, "kiln-egress")[0]


class CreateRecorder:
    """The engine's ``create`` events of containers of ``image`` (a tag only this test uses), each inspected as it
    arrives (a one-shot container is gone soon after)."""

    def __init__(self, client: Any, image: str) -> None:
        self.client, self.image = client, image
        self.seen: dict[str, dict[str, Any] | str] = {}
        self._events = client.events(decode=True, filters={"type": "container", "event": "create", "image": image})
        self._thread = threading.Thread(target=self._record, daemon=True)
        self._thread.start()

    def _record(self) -> None:
        with contextlib.suppress(Exception):  # the stream closed
            for event in self._events:
                cid = event.get("id") or event.get("Actor", {}).get("ID")
                try:
                    self.seen[cid] = self.client.api.inspect_container(cid)
                except Exception as e:  # removed before it could be inspected: recorded, and fails the test
                    self.seen[cid] = f"not inspected: {e}"

    def close(self, expected: int, timeout_s: float = 10) -> dict[str, dict[str, Any] | str]:
        deadline = time.monotonic() + timeout_s
        while len(self.seen) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # anything later than expected
        self._events.close()
        return dict(self.seen)


@pytest.fixture
def image(docker_engine: Any) -> Iterator[str]:
    """kiln's toolchain image under a tag of its own, so the events of this test's containers are told apart from
    those of tests running beside it."""
    tag = f"kiln/sandbox-policy-{uuid.uuid4().hex[:12]}:latest"
    docker_engine.images.get("kiln/toolchain:latest").tag(tag)
    try:
        yield tag
    finally:
        with contextlib.suppress(Exception):
            docker_engine.images.remove(tag, noprune=True)


@pytest.mark.timeout(90)
def test_every_container_the_sandboxing_code_creates_follows_the_policy(docker_engine: Any, image: str,
                                                                       tmp_path: Path) -> None:
    manager = SessionManager(docker_engine, f"policy-{uuid.uuid4().hex[:8]}", None, ["kiln/"])
    manager.image_work(image)  # the image's /work read (a created, never started container) before recording
    pool = RunnerPool(docker_engine, manager.sealed_labels, lambda: supervisor_binary(Path.home() / ".cache" / "kiln"),
                      manager.image_work, per_key=1, keys=1)
    pool.ready()
    build = BuildSandbox()
    recorder = CreateRecorder(docker_engine, image)
    session = runner = None
    try:
        # An exec session, a run_once runner, the builder's test run, a build step, the repair agent.
        session = manager.create_container(image, SessionLimits(memory_mb=256))
        runner = pool.start(runner_key(image, SessionLimits()), SessionLimits())
        result = run_sandboxed(docker_engine, image, "sleep 1; id -u", limits=sandbox.Limits(timeout_s=30),
                               role="kiln-policy-test")
        assert result.exit_code == 0 and result.output.strip() == "1000"
        # A rebuild of no changed file (the repository is not read): the step runs, its layer is what it wrote.
        layer = layers.rebuild_layer(docker_engine, image, cast(Repository, None), layers.Diff({}, []),
                                     "sleep 1; echo step > /tmp/policy-step", {}, 30)
        assert layer
        # The agent on a checkout with no command to try: its container is made, then it gives up.
        built, *_ = agent_image(docker_engine, image, _checkout(tmp_path), f"{image.rsplit(':', 1)[0]}:agent",
                                {}, budget=0, model=None, timeout_s=10)
        assert not built
        seen = recorder.close(expected=5)
    finally:
        recorder._events.close()
        if session is not None:
            manager.remove(session[0], session[1])
        if runner is not None:
            pool.discard(runner)
    assert len(seen) >= 5, seen
    problems = [p for attrs in seen.values()
                for p in ([attrs] if isinstance(attrs, str) else sandbox.violations(attrs, build.network))]
    assert problems == []
    profiles = {attrs["Config"]["Labels"][sandbox.PROFILE_LABEL] for attrs in seen.values() if isinstance(attrs, dict)}
    assert profiles >= {"exec-session", "exec-runner", "test-run", "build-step", "build-agent"}


def _checkout(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "README.md").write_text("nothing to test here\n")
    return checkout
