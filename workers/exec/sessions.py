"""Exec sessions: one isolated container per session, on this worker's Docker engine.

A session container runs the image read-only, without network, capabilities or new privileges, with CPU/memory/
pids limits and an init; its only writable places are two size-limited tmpfs volumes, ``/work`` (populated with
the image's ``/work`` or a snapshot) and ``/tmp``, so snapshots capture all state. Every command runs as uid 1000
through ``docker exec`` under ``timeout -s KILL``, and when it returns, ``kill -9 -1`` *as uid 1000* ends whatever
it left behind (background jobs, setsid escapees, fork bombs, SIGTERM-ignorers): processes never outlive their
command. That is the in-container way to kill an exec's tree (the Docker API cannot); the container's init and
its idle keeper run as a capability-less root that uid 1000 cannot signal. A host-side watchdog kills by host pid
if a command still runs well past its limit.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import io
import os
import secrets
import shlex
import signal
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zstandard
from docker.errors import APIError, DockerException, NotFound

from kiln.schemas.exec import CommandOutput, FileContent, SessionLimits
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import InfraError, RoutineJobError
from kiln.workers.common.containers import untar_files

ROLE = "exec-session"
MAX_READ_BYTES = 16 << 20


class SessionError(RoutineJobError):
    """The request cannot apply to the session (bad path, image not allowed, ...): an answer, not a dead letter."""


class SessionDenied(SessionError):
    """The token does not match the session."""


class SessionLost(SessionError):
    """The session's container is gone (its worker died, or it expired); open a new one."""


@dataclass
class Session:
    id: str
    token_hash: str
    client_id: str
    image: str
    limits: SessionLimits
    container: Any
    volumes: list[str]
    keeper_pid: int
    init_pid: int
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def safe_path(path: str) -> str:
    """A path relative to /work; absolute paths, ``..`` and NUL are refused."""
    if "\0" in path or path.startswith("/") or len(path) > 4096:
        raise SessionError(f"path {path[:100]!r} must be relative to /work")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise SessionError(f"path {path[:100]!r} escapes /work")
    return "/".join(parts)


def _tar(files: list[tuple[str, bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path, data, mode in files:
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, 1000, 1000, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _read_capped(stream: Any, cap: int) -> tuple[bytes, bytes, bool, bool]:
    out, err = bytearray(), bytearray()
    out_cut = err_cut = False
    for chunk_out, chunk_err in stream:
        for chunk, buf, which in ((chunk_out, out, "out"), (chunk_err, err, "err")):
            if not chunk:
                continue
            room = cap - len(buf)
            if room > 0:
                buf += chunk[:room]
            if len(chunk) > room:
                if which == "out":
                    out_cut = True
                else:
                    err_cut = True
    return bytes(out), bytes(err), out_cut, err_cut


class SessionManager:
    def __init__(self, client: Any, worker_id: str, blobs: BlobStore | None, image_prefixes: list[str]) -> None:
        self.client = client
        self.worker_id = worker_id
        self.blobs = blobs
        self.image_prefixes = image_prefixes
        self.sessions: dict[str, Session] = {}
        self._work_tars: dict[str, bytes] = {}
        self._lock = threading.Lock()

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def check_image(self, image: str) -> None:
        if not any(image.startswith(p) for p in self.image_prefixes):
            raise SessionError(f"image {image!r} is not allowed (allowed prefixes: {', '.join(self.image_prefixes)})")

    def create_container(self, image: str, limits: SessionLimits) -> tuple[Any, list[str], int, int]:
        """A running, empty-workspace container for ``image``; returns it, its volumes, keeper and init host pids."""
        name = f"kiln-x-{uuid.uuid4().hex[:16]}"
        half = max(4, limits.disk_mb // 2)
        volumes = []
        try:
            for where in ("work", "tmp"):
                volume = f"{name}-{where}"
                self.client.volumes.create(volume, driver="local", labels={"kiln.role": ROLE},
                                           driver_opts={"type": "tmpfs", "device": "tmpfs",
                                                        "o": f"size={half}m,uid=1000,gid=1000,mode=0755"})
                volumes.append(volume)
            container = self.client.containers.run(
                image, ["sleep", "infinity"], name=name, detach=True, network_mode="none", user="0:0",
                read_only=True, volumes={volumes[0]: {"bind": "/work", "mode": "rw"},
                                         volumes[1]: {"bind": "/tmp", "mode": "rw"}},
                working_dir="/work", mem_limit=limits.memory_mb << 20, memswap_limit=limits.memory_mb << 20,
                nano_cpus=int(limits.cpus * 1e9), pids_limit=limits.pids, security_opt=["no-new-privileges"],
                cap_drop=["ALL"], init=True, labels={"kiln.role": ROLE, "kiln.worker": self.worker_id},
                environment={"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
            )
            container.reload()
            init_pid = int(container.attrs["State"]["Pid"])
            keeper = next((int(p[1]) for p in container.top()["Processes"] if "sleep" in p[-1]), init_pid)
        except (APIError, DockerException) as e:
            self.remove(None, volumes)
            raise InfraError(f"starting a session container from {image}: {e}") from e
        return container, volumes, keeper, init_pid

    def populate(self, container: Any, image: str, snapshot: str | None) -> None:
        """Fill /work (and /tmp) from the image's /work, or from a snapshot."""
        if snapshot is not None:
            if self.blobs is None:
                raise SessionError("snapshots need a blob store")
            with tarfile.open(fileobj=io.BytesIO(zstandard.ZstdDecompressor().decompress(
                    self.blobs.get(snapshot), max_output_size=16 << 30))) as outer:
                for where in ("work", "tmp"):
                    member = outer.extractfile(f"{where}.tar")
                    if member is not None:
                        container.put_archive(f"/{where}", member.read())
            return
        content = self._image_work(image)
        if content:
            container.put_archive("/work", content)

    def _image_work(self, image: str) -> bytes:
        """The image's /work as a tar, read once per image id (an image without /work gives an empty area)."""
        image_id = str(self.client.images.get(image).id)
        with self._lock:
            cached = self._work_tars.get(image_id)
        if cached is not None:
            return cached
        source = self.client.containers.create(image, ["true"], network_mode="none")
        try:
            stream, _ = source.get_archive("/work/.")
            content = b"".join(stream)
        except NotFound:
            content = b""
        finally:
            source.remove(force=True)
        with self._lock:
            self._work_tars[image_id] = content
            while len(self._work_tars) > 8:
                self._work_tars.pop(next(iter(self._work_tars)))
        return content

    def adopt(self, container: Any, volumes: list[str], keeper: int, init_pid: int, image: str,
              limits: SessionLimits, client_id: str) -> tuple[Session, str]:
        token = secrets.token_urlsafe(32)
        session = Session(id=uuid.uuid4().hex, token_hash=hash_token(token), client_id=client_id, image=image,
                          limits=limits, container=container, volumes=volumes, keeper_pid=keeper, init_pid=init_pid)
        with self._lock:
            self.sessions[session.id] = session
        return session, token

    def get(self, session_id: str | None, token: str | None) -> Session:
        with self._lock:
            session = self.sessions.get(session_id or "")
        if session is None:
            raise SessionLost("unknown session: lost with the worker that held it, expired, or never opened")
        if not hmac.compare_digest(session.token_hash, hash_token(token or "")):
            raise SessionDenied("wrong token for this session")
        if not self._alive(session):
            self.close(session)
            raise SessionLost(f"session {session.id} lost its container")
        session.last_used = time.monotonic()
        return session

    def _alive(self, session: Session) -> bool:
        try:
            session.container.reload()
        except (APIError, DockerException):
            return False
        return bool(session.container.status == "running")

    def close(self, session: Session) -> None:
        with self._lock:
            self.sessions.pop(session.id, None)
        self.remove(session.container, session.volumes)

    def remove(self, container: Any, volumes: list[str]) -> None:
        if container is not None:
            with contextlib.suppress(APIError, DockerException):
                container.remove(force=True)
        for volume in volumes:
            with contextlib.suppress(APIError, DockerException):
                self.client.volumes.get(volume).remove(force=True)

    def expire_idle(self) -> int:
        now = time.monotonic()
        with self._lock:
            idle = [s for s in self.sessions.values() if now - s.last_used > s.limits.idle_timeout_s]
        for session in idle:
            self.close(session)
        return len(idle)

    # --- operations ----------------------------------------------------------------------------------------------

    def run(self, session: Session, command: str, timeout_s: float, cap: int,
            env: dict[str, str] | None = None) -> CommandOutput:
        started = time.monotonic()
        try:
            wrapper = (f"timeout -s KILL {timeout_s:g} bash -c {shlex.quote(command)}; rc=$?; "
                       "for _ in 1 2 3; do kill -9 -1 2>/dev/null; done; exit $rc")
            exec_id = self.client.api.exec_create(session.container.id, ["bash", "-c", wrapper], user="1000:1000",
                                                  workdir="/work", environment={"HOME": "/tmp", **(env or {})})["Id"]
            stream = self.client.api.exec_start(exec_id, stream=True, demux=True)
        except (APIError, DockerException) as e:
            raise InfraError(f"exec in session {session.id}: {e}") from e
        watchdog = threading.Timer(timeout_s + 5.0, self.kill_strays, args=(session,))
        watchdog.daemon = True
        watchdog.start()
        try:
            out, err, out_cut, err_cut = _read_capped(stream, cap)
        finally:
            watchdog.cancel()
        code = self.client.api.exec_inspect(exec_id).get("ExitCode")
        elapsed = time.monotonic() - started
        timed_out = code == 137 and elapsed >= timeout_s * 0.95
        return CommandOutput(exit_code=code, stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                             stdout_truncated=out_cut, stderr_truncated=err_cut, timed_out=timed_out,
                             duration_s=round(elapsed, 4))

    def kill_strays(self, session: Session) -> int:
        """SIGKILL, by host pid, every process in the container but its init and keeper."""
        killed = 0
        try:
            processes = session.container.top(ps_args="-eo pid,args")["Processes"]
        except (APIError, DockerException):
            return 0
        for row in processes:
            pid = int(row[0])
            if pid in (session.init_pid, session.keeper_pid):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        return killed

    def write_files(self, session: Session, files: list[FileContent]) -> None:
        entries = []
        for f in files:
            data = f.text.encode() if f.text is not None else base64.b64decode(f.content_b64 or "", validate=True)
            entries.append((safe_path(f.path), data, f.mode))
        self._put(session, "/work", _tar(entries))

    def _put(self, session: Session, where: str, data: bytes) -> None:
        try:
            session.container.put_archive(where, data)
        except (APIError, DockerException) as e:
            raise SessionError(f"writing into the session failed (work area full?): {e}") from e

    def read_files(self, session: Session, paths: list[str]) -> list[FileContent]:
        out = []
        for path in paths:
            rel = safe_path(path)
            try:
                stream, stat = session.container.get_archive(f"/work/{rel}")
            except NotFound:
                raise SessionError(f"no file {rel!r} in the session") from None
            if int(stat.get("size", 0)) > MAX_READ_BYTES:
                raise SessionError(f"{rel!r} is larger than {MAX_READ_BYTES} bytes")
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                member = tar.next()
                extracted = tar.extractfile(member) if member is not None and member.isfile() else None
                if extracted is None:
                    raise SessionError(f"{rel!r} is not a regular file")
                data = extracted.read()
            try:
                out.append(FileContent(path=rel, text=data.decode()))
            except UnicodeDecodeError:
                out.append(FileContent(path=rel, content_b64=base64.b64encode(data).decode()))
        return out

    def put_tmp(self, session: Session, name: str, data: bytes) -> str:
        self._put(session, "/tmp", _tar([(name, data, 0o600)]))
        return f"/tmp/{name}"

    def collect(self, session: Session, directory: str) -> dict[str, bytes]:
        try:
            stream, _ = session.container.get_archive(directory)
        except NotFound:
            return {}
        return untar_files(b"".join(stream))

    def snapshot(self, session: Session) -> tuple[str, int]:
        if self.blobs is None:
            raise SessionError("snapshots need a blob store")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as outer:
            for where in ("work", "tmp"):
                stream, _ = session.container.get_archive(f"/{where}/.")
                data = b"".join(stream)
                info = tarfile.TarInfo(f"{where}.tar")
                info.size = len(data)
                outer.addfile(info, io.BytesIO(data))
        packed = zstandard.ZstdCompressor(level=3).compress(buffer.getvalue())
        return self.blobs.put(packed).digest, len(packed)
