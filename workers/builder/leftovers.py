"""What a dead builder leaves behind: the containers of the builds it was running when it died (``docker build``'s
step containers, test runs, layered rebuilds, the agent's), removed by the next builder of the host — on a worker
node, the one started when the node comes back.

The pattern is the exec reaper's (``workers/exec/reaper.py``; the lock in ``workers/common/liveness.py``):
every builder worker holds a liveness lock
(``LivenessLock``, ``KILN_BUILD_LOCK_DIR``) while alive, and a container is judged by its worker's lock. A build
container names its worker through its cgroup parent, ``<KILN_BUILD_CGROUP>/<worker id>``: the engine records it
in the container's host configuration, which kiln sets on every container of a build (``docker build``'s own step
containers included: its API takes a cgroup parent and no labels) and which no image can set — unlike a label, it
cannot be forged by what is being built. A worker id carries where its lock is (the lock directory, in this boot
and mount namespace, as exec's ``kiln.lock`` and ``kiln.lockns`` labels do): containers of workers whose lock this
one cannot see are left alone. The worker's own cgroup directories go with it (its teardown, or the reaper).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from docker.errors import APIError, DockerException

from kiln.workers.common.liveness import LivenessLock, namespace, owner_alive

log = logging.getLogger(__name__)

_WORKER_ID = re.compile(r"build-([0-9a-f]{8})-[0-9a-f]+-[0-9a-f]+")


CGROUP_ROOT = Path("/sys/fs/cgroup")


def scope(lock_dir: Path) -> str:
    """Where a worker's lock lives: ``lock_dir`` in this boot and mount namespace (exec's ``namespace``), as 8 hex
    digits."""
    return hashlib.sha256(f"{namespace()}:{lock_dir.resolve()}".encode()).hexdigest()[:8]


class BuildWorker:
    """This process's builder: its id and liveness lock, held from the stage's setup to its teardown."""

    def __init__(self) -> None:
        self.id = ""
        self.lock: LivenessLock | None = None

    def hold(self, lock_dir: Path) -> None:
        self.id = f"build-{scope(lock_dir)}-{int(time.time() * 1000):x}-{os.getpid():x}"
        self.lock = LivenessLock(lock_dir, self.id)
        self.lock.hold()

    def release(self, parent: str) -> None:
        """Give the lock up, and the cgroup directories this worker's builds ran in below ``parent``."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            forget_cgroup(parent, self.id)

    def cgroup(self, parent: str) -> str:
        """The cgroup parent of this worker's build containers: its own below ``parent`` while it holds its lock
        (a build run outside a worker — a test, a bench — runs under ``parent`` itself)."""
        return f"{parent.rstrip('/')}/{self.id}" if self.lock is not None else parent


WORKER = BuildWorker()


def owner(attrs: Mapping[str, Any], parent: str) -> str | None:
    """The builder worker whose build made the container ``attrs`` (``docker inspect``), from its cgroup parent;
    None for a container of no builder worker."""
    cgroup = str((attrs.get("HostConfig") or {}).get("CgroupParent") or "")
    head, _, worker = cgroup.rpartition("/")
    return worker if head == parent.rstrip("/") and _WORKER_ID.fullmatch(worker) else None


def dead(worker: str, lock_dir: Path) -> bool:
    """``worker`` (an id ``owner`` returned) keeps its lock in ``lock_dir``, here, and no longer holds it."""
    match = _WORKER_ID.fullmatch(worker)
    return (match is not None and match.group(1) == scope(lock_dir) and worker != WORKER.id
            and not owner_alive(lock_dir / f"{worker}.lock"))


def forget_cgroup(parent: str, worker: str) -> None:
    """Remove ``worker``'s cgroup directories below ``parent`` (cgroup v1: one per controller; v2: one), where
    this process sees the engine's cgroups and they are empty; elsewhere nothing happens."""
    for directory in [*CGROUP_ROOT.glob(f"*/{parent.strip('/')}/{worker}"), CGROUP_ROOT / parent.strip("/") / worker]:
        with contextlib.suppress(OSError):
            directory.rmdir()


def reap(client: Any, parent: str, lock_dir: Path) -> int:
    """Remove the build containers of dead builders whose locks are in ``lock_dir`` (with their anonymous
    volumes) and those builders' cgroup directories; how many containers."""
    try:
        containers = client.containers.list(all=True)
    except (APIError, DockerException):
        return 0
    removed, gone = 0, set[str]()
    for container in containers:
        worker = owner(container.attrs, parent)
        if worker is None or not (worker in gone or dead(worker, lock_dir)):
            continue
        gone.add(worker)
        with contextlib.suppress(APIError, DockerException):
            container.remove(force=True, v=True)
            removed += 1
            log.info("removed %s, left by dead builder %s", container.short_id, worker)
    for worker in gone:
        forget_cgroup(parent, worker)
    return removed
