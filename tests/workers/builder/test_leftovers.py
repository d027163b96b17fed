"""A builder that dies mid-build leaves its build's containers behind (here a test run: the process that would
have removed it is gone); the next builder removes them, judged by the dead worker's liveness lock through the cgroup
parent the engine recorded — and leaves alone a live builder's containers, those of builders whose locks live
elsewhere, and containers no builder made. The bench's node scenario (bench/nodes.py) does the same across a whole
node's loss, its engine included."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker.errors import APIError, NotFound

from kiln.workers.builder import leftovers
from kiln.workers.common import sandbox
from kiln.workers.common.liveness import LivenessLock

IMAGE = "kiln/base:latest"

# A builder worker in its own process: it holds its lock, starts a build's test run and is SIGKILLed during it.
CHILD = """import sys
from pathlib import Path
import docker
from kiln.workers.builder.leftovers import WORKER
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.common.containers import Limits, run_sandboxed
WORKER.hold(Path(sys.argv[1]))
print(WORKER.id, flush=True)
run_sandboxed(docker.from_env(), sys.argv[2], "sleep 300", limits=Limits(timeout_s=600), role="build-test",
              cgroup_parent=BuildSandbox().worker_cgroup())
"""


@pytest.fixture
def parent() -> Iterator[str]:
    """A cgroup parent of this test's own (no other build's containers are judged), removed afterwards."""
    name = f"kiln-test-builds-{uuid.uuid4().hex[:8]}"
    yield name
    for root in [*leftovers.CGROUP_ROOT.glob(f"*/{name}"), leftovers.CGROUP_ROOT / name]:
        for directory, _, _ in sorted(os.walk(root), key=lambda walked: -len(walked[0])):  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def test_a_container_names_its_builder_by_its_cgroup_parent_only(tmp_path: Path) -> None:
    worker = f"build-{leftovers.scope(tmp_path)}-18c3-2a"
    assert leftovers.owner({"HostConfig": {"CgroupParent": f"kiln-builds/{worker}"}}, "kiln-builds") == worker
    assert leftovers.owner({"HostConfig": {"CgroupParent": f"kiln-node-1/builds/{worker}"}},
                           "kiln-node-1/builds/") == worker
    for cgroup in (f"other/{worker}", f"kiln-builds/x/{worker}", "kiln-builds/exec-18c3-2a", "kiln-builds", ""):
        assert leftovers.owner({"HostConfig": {"CgroupParent": cgroup}}, "kiln-builds") is None, cgroup
    assert leftovers.owner({"Config": {"Labels": {"kiln.lock": str(tmp_path / f"{worker}.lock")}}},
                           "kiln-builds") is None  # labels (which an image can set) name no one


def test_only_a_builder_that_let_its_lock_go_is_dead(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    held = LivenessLock(locks, f"build-{leftovers.scope(locks)}-1-1")
    held.hold()
    try:
        let_go = locks / f"build-{leftovers.scope(locks)}-2-2.lock"
        let_go.write_text("")
        assert not leftovers.dead(held.path.stem, locks)
        assert leftovers.dead(let_go.stem, locks) and not let_go.exists()
        assert leftovers.dead(f"build-{leftovers.scope(locks)}-3-3", locks)  # no lock file at all
        # A worker whose lock is in another directory is not judged here, whatever this one holds.
        assert not leftovers.dead(f"build-{leftovers.scope(tmp_path / 'elsewhere')}-4-4", locks)
    finally:
        held.release()


def test_a_worker_runs_its_builds_in_a_cgroup_of_its_own_while_it_holds_its_lock(tmp_path: Path) -> None:
    worker = leftovers.BuildWorker()
    assert worker.cgroup("kiln-builds") == "kiln-builds"
    worker.hold(tmp_path)
    try:
        assert worker.cgroup("kiln-builds") == f"kiln-builds/{worker.id}"
        assert leftovers.owner({"HostConfig": {"CgroupParent": worker.cgroup("kiln-builds")}},
                               "kiln-builds") == worker.id
        assert not leftovers.dead(worker.id, tmp_path)
    finally:
        worker.release(f"kiln-test-none-{uuid.uuid4().hex[:8]}")
    assert worker.cgroup("kiln-builds") == "kiln-builds" and not any(tmp_path.glob("*.lock"))


def _under(engine: Any, cgroup: str) -> list[Any]:
    return [c for c in engine.containers.list(all=True, filters={"label": "kiln.role=build-test"})
            if (c.attrs.get("HostConfig") or {}).get("CgroupParent") == cgroup]


@pytest.mark.docker
def test_a_dead_builders_containers_are_reaped_and_no_one_elses(docker_engine: Any, tmp_path: Path,
                                                                  parent: str) -> None:
    locks = tmp_path / "locks"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(locks), IMAGE], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "KILN_BUILD_CGROUP": parent})
    assert child.stdout is not None
    dead_id = child.stdout.readline().strip()
    live = LivenessLock(locks, f"build-{leftovers.scope(locks)}-1-1")
    live.hold()
    made: list[Any] = []
    try:
        deadline = time.monotonic() + 60
        while not [c for c in _under(docker_engine, f"{parent}/{dead_id}") if c.status == "running"]:
            assert child.poll() is None and time.monotonic() < deadline, "the builder's test run never started"
            time.sleep(0.2)
        left = _under(docker_engine, f"{parent}/{dead_id}")
        child.kill()
        child.wait(10)

        def container(cgroup: str | None) -> Any:
            made.append(sandbox.create(docker_engine, IMAGE, ["sleep", "300"], profile=sandbox.TEST_RUN,
                                       limits=sandbox.Limits(), labels={"kiln.role": "build-test"}, start=True,
                                       cgroup_parent=cgroup))
            return made[-1]

        alive = container(f"{parent}/{live.path.stem}")
        elsewhere = container(f"{parent}/build-{leftovers.scope(tmp_path / 'other')}-2-2")  # its lock: not here
        plain = container(None)
        assert len(left) == 1 and leftovers.owner(left[0].attrs, parent) == dead_id
        assert leftovers.reap(docker_engine, parent, locks) == 1
        with pytest.raises(NotFound):
            left[0].reload()
        for kept in (alive, elsewhere, plain):
            kept.reload()
            assert kept.status == "running"
        assert not (locks / f"{dead_id}.lock").exists()  # the dead worker's lock file went with it
        assert not any(leftovers.CGROUP_ROOT.glob(f"*/{parent}/{dead_id}"))  # and its cgroup directories
        assert leftovers.reap(docker_engine, parent, locks) == 0
    finally:
        if child.poll() is None:
            child.kill()
        for c in made + _under(docker_engine, f"{parent}/{dead_id}"):
            with contextlib.suppress(NotFound, APIError):
                c.remove(force=True)
        live.release()
