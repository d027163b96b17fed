"""The reaper: it judges containers by the liveness lock their worker holds (``workers/common/liveness.py``).

Every exec worker holds a lock file while alive (``LivenessLock``) and labels its containers with that file's path
and its mount namespace, sealed (``sessions.LabelSeal``: an image's own labels prove nothing). The reaper removes
session containers of dead workers, this worker's own strays and idle sessions: it judges only sealed containers
whose lock it can see (same namespace) and never creates the lock it checks; containers of workers it cannot see
are removed only past the longest a session may live (``KILN_EXEC_MAX_SESSION_AGE_S``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from docker.errors import APIError, DockerException

from kiln.workers.common.liveness import namespace, owner_alive
from kiln.workers.exec.metrics import REAPED, SESSIONS
from kiln.workers.exec.sessions import ROLE, SessionManager


class Reaper:
    """Judges the host's sealed session containers (``reap``); ``ours`` names the containers this worker holds
    (sessions, warm ones, those being opened, runners): none of them is ever a stray."""

    def __init__(self, manager: SessionManager, worker_id: str, max_session_age_s: float,
                 ours: Callable[[], set[str]]) -> None:
        self.manager = manager
        self.worker_id = worker_id
        self.max_session_age_s = max_session_age_s
        self._ours = ours

    def reap(self) -> None:
        """Remove session containers of dead workers, our own strays, and idle sessions. Only labels a seal of this
        host covers are read: an image's own labels imitating kiln's (Docker merges them into its containers')
        make a container the reaper never touches."""
        manager = self.manager
        idle = manager.expire_idle()
        if idle:
            REAPED.labels("idle").inc(idle)
        ours = {s.container.id for s in manager.sessions.values()} | self._ours()
        try:
            containers = manager.client.containers.list(all=True, filters={"label": f"kiln.role={ROLE}"})
        except (APIError, DockerException):
            return
        here = namespace()
        for container in containers:
            labels = manager.seal.recorded(container.name, container.labels)
            if labels is None:  # not created by kiln on this host (or by one before seals): not ours to judge
                continue
            age = time.time() - created(container)
            if labels.get("kiln.worker", "") == self.worker_id:
                if container.id not in ours and age > 60:
                    self._reap(container, "stray")
            elif labels.get("kiln.lockns") == here and labels.get("kiln.lock"):
                if not owner_alive(Path(labels["kiln.lock"])):
                    self._reap(container, "worker_gone")
            elif age > self.max_session_age_s:  # a worker this one cannot see: only the age tells
                self._reap(container, "expired")
        SESSIONS.set(len(manager.sessions))

    def _reap(self, container: Any, reason: str) -> None:
        name = container.name
        mounted = [str(m.get("Name", "")) for m in container.attrs.get("Mounts") or [] if m.get("Type") == "volume"]
        # The session's own volumes (work, tmp, those on paths its image declares): named after it, kiln-made.
        volumes = {f"{name}-work", f"{name}-tmp", *(v for v in mounted if v.startswith(f"{name}-"))}
        self.manager.remove(container, sorted(volumes))
        REAPED.labels(reason).inc()


def created(container: Any) -> float:
    raw = str(container.attrs.get("Created", ""))[:19]
    try:
        return datetime.strptime(raw, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0
