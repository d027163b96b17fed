"""One-shot calls (``run_once``) in warm runner containers: a call costs a process, not a container.

A runner is a container like a session's (read-only image, no network, CPU/memory/pids limits, size-limited tmpfs work
areas, no new privileges: the sandbox policy's ``RUNNER`` profile, ``workers/common/sandbox.py``) whose only extra is
a trusted supervisor (``supervisor/main.go``, a static binary kiln builds once per source and copies into the
container's root-only ``/kiln``). It runs as root with nothing but CAP_SETUID, CAP_SETGID and CAP_KILL, reached over
one attached ``docker exec`` stream: a call is one JSON line there and back, with no Docker API round trip. It runs
the call's steps as uid 1000 and measures them itself, then kills every uid-1000 process and wipes every writable
place; a runner with anything left of a call is discarded and replaced off the hot path. One call at a time per
runner, so a call's limits are its container's.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from docker.errors import APIError, DockerException

from kiln.schemas.exec import SessionLimits
from kiln.streams.errors import InfraError
from kiln.workers.common import sandbox
from kiln.workers.common.sandbox import Limits
from kiln.workers.exec.sessions import image_volumes

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("supervisor")
RunnerKey = tuple[str, int, float, int, int]  # image, memory_mb, cpus, pids, disk_mb


def runner_key(image: str, limits: SessionLimits) -> RunnerKey:
    return image, limits.memory_mb, limits.cpus, limits.pids, limits.disk_mb


def supervisor_binary(cache: Path, prebuilt: Path | None = None) -> bytes:
    """The supervisor's static binary: ``prebuilt`` when given (an image that ships it), else built with Go once
    per source digest into ``cache``."""
    if prebuilt is not None:
        return prebuilt.read_bytes()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCE.glob("*")) if p.is_file()))
    target = cache / f"exec-supervisor-{digest.hexdigest()[:16]}"
    if not target.exists():
        go = shutil.which("go") or next((g for g in ("/usr/local/go/bin/go", "/usr/lib/go/bin/go")
                                         if Path(g).exists()), None)
        if go is None:
            raise InfraError("the exec supervisor needs Go to build (or KILN_EXEC_SUPERVISOR: a built binary)")
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{uuid.uuid4().hex[:8]}")
        done = subprocess.run([go, "build", "-trimpath", "-ldflags=-s", "-o", str(partial), "."], cwd=SOURCE,
                              capture_output=True, text=True, check=False,
                              env={**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"})
        if done.returncode != 0:
            raise InfraError(f"building the exec supervisor failed: {done.stderr[-2000:]}")
        partial.replace(target)  # atomic: workers building at once each install a whole binary
    return target.read_bytes()


@dataclass
class Runner:
    key: RunnerKey
    container: Any
    sock: Any
    base: bytes  # the image's /work (a tar), restored by the supervisor before every call
    calls: int = 0
    _out: bytearray = field(default_factory=bytearray)
    _err: bytearray = field(default_factory=bytearray)

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One call: the request line out, the supervisor's answer line back (within ``timeout_s``)."""
        if self.calls == 0 and self.base:
            request = {**request, "base": base64.b64encode(self.base).decode()}
        raw = getattr(self.sock, "_sock", self.sock)
        raw.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            raw.sendall(json.dumps(request).encode() + b"\n")
            while b"\n" not in self._out:
                if time.monotonic() > deadline:
                    raise TimeoutError
                self._frame(raw)
        except (OSError, TimeoutError) as e:
            raise InfraError(f"runner {self.container.name} did not answer: {e or 'timed out'}; "
                             f"{self._err[-500:].decode(errors='replace')}") from None
        line, _, rest = bytes(self._out).partition(b"\n")
        self._out[:] = rest
        self.calls += 1
        try:
            answer: dict[str, Any] = json.loads(line)
        except ValueError as e:
            raise InfraError(f"runner {self.container.name} answered {line[:200]!r}: {e}") from None
        return answer

    def _frame(self, raw: Any) -> None:
        """One frame of Docker's multiplexed stream: 1 byte stream, 3 zero bytes, 4 bytes big-endian length."""
        header = _exactly(raw, 8)
        stream, size = header[0], struct.unpack(">I", header[4:])[0]
        payload = _exactly(raw, size)
        if stream == 1:
            self._out += payload
        else:  # the supervisor's own diagnostics, kept short
            self._err = (self._err + payload)[-4096:]


def _exactly(raw: Any, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = raw.recv(min(left, 1 << 20))
        if not chunk:
            raise OSError("the runner's stream ended")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class RunnerPool:
    """Idle runners per (image, limits), at most ``per_key`` each and ``keys`` images; a discarded runner is
    replaced in the background."""

    def __init__(self, client: Any, labels: Callable[[str], dict[str, str]], supervisor: Callable[[], bytes],
                 image_work: Callable[[str], bytes], per_key: int, keys: int) -> None:
        self.client, self.labels = client, labels  # labels(name): the sealed labels of a new container
        self._supervisor, self._binary = supervisor, b""
        self._image_work = image_work
        self.per_key, self.keys = per_key, keys
        self._idle: OrderedDict[RunnerKey, list[Runner]] = OrderedDict()
        self._busy: dict[str, Runner] = {}
        self._starting: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False

    def ready(self) -> None:
        """The supervisor at hand (built now if need be), so the first call does not wait for a build."""
        if not self._binary:
            self._binary = self._supervisor()

    def serves(self, image: str) -> bool:
        """Whether a runner of ``image`` exists here (so the engine has the image: no need to ask it again)."""
        with self._lock:
            return any(r.key[0] == image for r in self._busy.values()) or any(
                key[0] == image and runners for key, runners in self._idle.items())

    def container_ids(self) -> set[str]:
        """Containers this pool owns (idle, busy or starting): never strays to the reaper."""
        with self._lock:
            return ({r.container.id for rs in self._idle.values() for r in rs} | set(self._busy)
                    | set(self._starting))

    def take(self, image: str, limits: SessionLimits) -> Runner:
        key = runner_key(image, limits)
        with self._lock:
            idle = self._idle.get(key)
            runner = idle.pop() if idle else None
            if runner is not None:
                self._idle.move_to_end(key)
        if runner is None:
            runner = self.start(key, limits)
        with self._lock:
            self._busy[runner.container.id] = runner
        return runner

    def give(self, runner: Runner, clean: bool) -> None:
        """Back to the pool after a call that left nothing behind; otherwise discarded (and replaced)."""
        with self._lock:
            self._busy.pop(runner.container.id, None)
            idle = self._idle.setdefault(runner.key, [])
            keep = clean and not self._closed and len(idle) < self.per_key
            if keep:
                idle.append(runner)
                self._idle.move_to_end(runner.key)
            dropped = self._trim()
        for old in dropped:
            self.discard(old)
        if not keep:
            self.discard(runner)
            if not clean:
                self._replace(runner.key)

    def _trim(self) -> list[Runner]:
        dropped: list[Runner] = []
        while len(self._idle) > self.keys:
            _, runners = self._idle.popitem(last=False)
            dropped += runners
        return dropped

    def _replace(self, key: RunnerKey) -> None:
        def start() -> None:
            with contextlib.suppress(InfraError):
                self.give(self.start(key, _limits(key)), True)
        threading.Thread(target=start, name="kiln-runner-replace", daemon=True).start()

    def prewarm(self, image: str, limits: SessionLimits, count: int) -> None:
        key = runner_key(image, limits)
        with self._lock:
            missing = count - len(self._idle.get(key, []))
        for _ in range(max(0, missing)):
            self.give(self.start(key, limits), True)

    def discard(self, runner: Runner) -> None:
        with self._lock:
            self._busy.pop(runner.container.id, None)
        with contextlib.suppress(OSError):
            runner.sock.close()
        with contextlib.suppress(APIError, DockerException):
            runner.container.remove(force=True)

    def start(self, key: RunnerKey, limits: SessionLimits) -> Runner:
        """A new runner: its container, the supervisor copied in and serving."""
        image = key[0]
        self.ready()
        name = f"kiln-r-{uuid.uuid4().hex[:16]}"
        half = max(4, limits.disk_mb // 2)
        tmpfs = {"/work": f"size={half}m,uid=1000,gid=1000,mode=0755,exec",
                 "/tmp": f"size={half}m,uid=1000,gid=1000,mode=1777,exec",
                 "/kiln": "size=32m,mode=0755,exec"}
        container = None
        try:
            # An image's VOLUMEs become tmpfs (no anonymous volume on the host disk): inside a work area writable
            # within the same budget (the supervisor empties them like the rest), elsewhere read-only and empty.
            for path in image_volumes(self.client, image):
                inside = path.startswith(("/work/", "/tmp/"))
                tmpfs.setdefault(path, f"size={max(1, half // 4)}m,uid=1000,gid=1000,mode=0755,exec" if inside
                                 else "size=64k,mode=0555,ro")
            container = sandbox.create(
                self.client, image, ["sleep", "infinity"], profile=sandbox.RUNNER, limits=Limits.of_session(limits),
                start=True, name=name, tmpfs=tmpfs, working_dir="/work", shm_bytes=min(64, half) << 20,
                labels=self.labels(name), environment={"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"})
            with self._lock:
                self._starting.add(container.id)
            self._install(container)
            sock = self._serve(container)
        except (APIError, DockerException, OSError) as e:
            if container is not None:
                with contextlib.suppress(APIError, DockerException):
                    container.remove(force=True)
            raise InfraError(f"starting a runner of {image}: {e}") from e
        finally:
            if container is not None:
                with self._lock:
                    self._starting.discard(container.id)
        return Runner(key, container, sock, self._image_work(image))

    def _install(self, container: Any) -> None:
        api = self.client.api
        exec_id = api.exec_create(container.id, ["sh", "-c", "cat > /kiln/sup && chmod 0755 /kiln/sup"],
                                  stdin=True, user="0:0")["Id"]
        sock = api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        try:
            raw.sendall(self._binary)
            raw.shutdown(socket.SHUT_WR)
            while raw.recv(65536):
                pass
        finally:
            sock.close()
        code = api.exec_inspect(exec_id).get("ExitCode")
        if code != 0:
            raise InfraError(f"copying the supervisor into {container.name} failed ({code})")

    def _serve(self, container: Any) -> Any:
        api = self.client.api
        exec_id = api.exec_create(container.id, ["/kiln/sup", "serve"], stdin=True, user="0:0", workdir="/")["Id"]
        return api.exec_start(exec_id, socket=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            runners = [r for rs in self._idle.values() for r in rs] + list(self._busy.values())
            self._idle.clear()
        for runner in runners:
            self.discard(runner)


def _limits(key: RunnerKey) -> SessionLimits:
    return SessionLimits(memory_mb=key[1], cpus=key[2], pids=key[3], disk_mb=key[4])
