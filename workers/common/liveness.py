"""A worker's liveness lock, shared by the reapers that judge a container by its worker's lock (exec's sessions,
the builder's leftovers): a worker holds ``<lock_dir>/<worker_id>.lock`` while alive; another worker of the host
reads it, never creating it, to tell a live worker's containers from a dead one's."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO


class LivenessLock:
    """``<lock_dir>/<worker_id>.lock``, held (an exclusive ``flock``) while this worker is alive: the reapers of
    other workers of the host read it to tell a live worker's sessions from a dead one's."""

    def __init__(self, lock_dir: Path, worker_id: str) -> None:
        self.lock_dir = lock_dir
        self.path = (lock_dir / f"{worker_id}.lock").resolve()
        self._file: IO[str] | None = None

    def hold(self) -> None:
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def release(self) -> None:
        """Close (releasing the lock) and remove the file."""
        if self._file is None:
            return
        path = Path(self._file.name)
        self._file.close()
        self._file = None
        path.unlink(True)


def namespace() -> str:
    """Where lock paths mean the same file: this boot's id and this process's mount namespace."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.readlink('/proc/self/ns/mnt')}"


def owner_alive(lock_path: Path) -> bool:
    """A worker is alive while it holds the exclusive lock on its lock file. The file is opened read-only, never
    created: a missing file means its worker is gone. The path comes from a sealed label (kiln wrote it); even so
    only a ``*.lock`` file is judged (and removed when stale), any other path counts as alive."""
    if lock_path.suffix != ".lock" or lock_path.name.startswith("."):
        return True
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        lock_path.unlink()
    return False
