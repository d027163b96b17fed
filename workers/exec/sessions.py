"""Exec sessions: one isolated container per session, on this worker's Docker engine.

A session container runs the image read-only, without network, capabilities or new privileges, with CPU/memory/
pids limits and an init; its only writable places are two size-limited tmpfs volumes, ``/work`` (populated with
the image's ``/work`` or a snapshot) and ``/tmp``, so snapshots capture all state. Every command runs as uid 1000
through ``docker exec`` under ``timeout -s KILL``. When it returns, kiln empties the container *from outside*: it
reads the container's cgroup (host pids) and SIGKILLs everything but the init and the idle keeper (capability-less
root, which uid 1000 cannot signal) until nothing else is left. The command cannot defeat that (killing its own
wrapper, setsid, fork bombs, SIGTERM-ignorers): nothing it starts outlives it, so nothing can touch the next
command's files or reports. File reads and writes run as uid 1000 inside the container too (one ``tar`` each) and
refuse any path that resolves outside ``/work``; Docker's archive API (root, follows symlinks, ignores the
read-only root and the disk limit) is used only on kiln's own areas.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shlex
import signal
import socket
import tarfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard
from docker.errors import APIError, DockerException, NotFound
from docker.utils.socket import consume_socket_output, demux_adaptor, frames_iter

from kiln.schemas.envelope import request_id_ms
from kiln.schemas.exec import CommandOutput, ExecRequest, ExecResult, FileContent, SessionLimits
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import BlobNotFound, InfraError, RoutineJobError
from kiln.workers.common.containers import untar_files
from kiln.workers.exec import auth

ROLE = "exec-session"
MAX_READ_BYTES = 16 << 20
MAX_READ_TOTAL = 64 << 20
# Run as uid 1000 inside the session, with the paths as arguments (never interpolated into the script).
_READ = f"""set -u; cd /work
readarray -d '' -t real < <(realpath -e -z -- "$@" 2>/dev/null)
if [ "${{#real[@]}}" -ne "$#" ]; then
  for p in "$@"; do [ -e "$p" ] || {{ printf 'no file %s in the session' "$p" >&2; exit 3; }}; done
  printf 'a path does not resolve' >&2; exit 3
fi
i=0
for r in "${{real[@]}}"; do
  p=${{@:$((i + 1)):1}}; i=$((i + 1))
  case "$r" in /work/?*) ;; *) printf '%s resolves outside /work' "$p" >&2; exit 4;; esac
  [ -f "$r" ] || {{ printf '%s is not a regular file' "$p" >&2; exit 5; }}
done
total=0; i=0
for size in $(stat -c %s -- "${{real[@]}}"); do
  i=$((i + 1)); total=$((total + size))
  [ "$size" -le {MAX_READ_BYTES} ] || {{ printf '%s is larger than {MAX_READ_BYTES} bytes' "${{@:$i:1}}" >&2; exit 6; }}
done
[ "$total" -le {MAX_READ_TOTAL} ] || {{ printf 'the files add up to more than {MAX_READ_TOTAL} bytes' >&2; exit 6; }}
exec tar -c -f - --dereference -- "$@"
"""
_WRITE = """set -u; cd /work
readarray -d '' -t real < <(realpath -m -z -- "$@")
i=0
for r in "${real[@]}"; do
  i=$((i + 1))
  case "$r" in /work/?*) ;; *) printf '%s resolves outside /work' "${@:$i:1}" >&2; exit 4;; esac
done
exec tar -x -f - -C /work --no-same-owner -p
"""


class SessionError(RoutineJobError):
    """The request cannot apply to the session (bad path, image not allowed, ...): an answer, not a dead letter."""


class SessionDenied(SessionError):
    """The request's proof does not match the session (forged, altered, or a replay past the window)."""


class SessionLost(SessionError):
    """The session's container is gone (its worker died, or it expired); open a new one."""


class LimitExceeded(SessionError):
    """A requested limit is above what this deployment allows (``KILN_EXEC_MAX_*``)."""


REPLAY_WINDOW = 4096  # results remembered per session for replayed request ids


@dataclass
class Session:
    id: str
    key: bytes
    client_id: str
    image: str
    limits: SessionLimits
    container: Any
    volumes: list[str]
    keeper_pid: int
    init_pid: int
    procs_file: Path | None = None  # the container's cgroup member list, read from outside
    partition: int = -1  # where its requests arrive: when that partition leaves this worker, the session is handed over
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Replays: request id -> first result; ids older than the forgotten watermark are refused.
    results: OrderedDict[str, ExecResult] = field(default_factory=OrderedDict)
    forgotten_ms: int = 0

    def answered(self, request_id: str) -> ExecResult | None:
        """The first result of ``request_id`` if it ran here; SessionDenied if it is too old to tell."""
        if request_id in self.results:
            return self.results[request_id]
        stamp = request_id_ms(request_id)
        if stamp is None:
            raise SessionDenied("session requests need ULID request ids (replays are judged by their time)")
        if stamp <= self.forgotten_ms:
            raise SessionDenied(f"request id {request_id} is older than this session's replay window")
        return None

    def remember(self, request_id: str, result: ExecResult) -> None:
        self.results[request_id] = result
        while len(self.results) > REPLAY_WINDOW:
            old, _ = self.results.popitem(last=False)
            self.forgotten_ms = max(self.forgotten_ms, request_id_ms(old) or 0)


def handover_name(session_id: str) -> str:
    return f"exec/handover/{session_id}"


def key_name(session_id: str) -> str:
    return f"exec/keys/{session_id}"


def snapshot_name(digest: str, session_id: str) -> str:
    return f"exec/snapshots/{digest.removeprefix('sha256:')}/{session_id}"


def cgroup_procs(init_pid: int) -> Path | None:
    """The ``cgroup.procs`` file of the cgroup ``init_pid`` lives in (cgroup v2, or v1's pids hierarchy)."""
    try:
        lines = Path(f"/proc/{init_pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "cgroup.procs"
        elif "pids" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup") / controllers / path.lstrip("/") / "cgroup.procs"
        else:
            continue
        if candidate.is_file():
            return candidate
    return None


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
    def __init__(self, client: Any, worker_id: str, blobs: BlobStore | None, image_prefixes: list[str],
                 labels: dict[str, str] | None = None) -> None:
        self.client = client
        self.worker_id = worker_id
        self.labels = {"kiln.role": ROLE, "kiln.worker": worker_id, **(labels or {})}
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
                cap_drop=["ALL"], init=True, labels=self.labels,
                environment={"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
            )
            container.reload()
            init_pid = int(container.attrs["State"]["Pid"])
            keeper = self._keeper(container, init_pid)
        except (APIError, DockerException) as e:
            self.remove(None, volumes)
            raise InfraError(f"starting a session container from {image}: {e}") from e
        return container, volumes, keeper, init_pid

    @staticmethod
    def _keeper(container: Any, init_pid: int) -> int:
        """The host pid of init's child ``sleep infinity`` (init's own command line names it too). Right after the
        start init may not have forked it yet: a sweep that took init's pid for the keeper's would kill the keeper
        and with it the session, so wait for it."""
        for _ in range(250):
            keeper = next((int(p[1]) for p in container.top()["Processes"]
                           if p[-1].startswith("sleep") and int(p[1]) != init_pid), None)
            if keeper is not None:
                return keeper
            time.sleep(0.02)
        raise InfraError(f"session container {container.name} did not start its keeper")

    def populate(self, container: Any, image: str, snapshot: str | None, limits: SessionLimits) -> None:
        """Fill /work (and /tmp) from the image's /work, or from a snapshot (decompressed no larger than the
        session's own work area could hold)."""
        if snapshot is not None:
            if self.blobs is None:
                raise SessionError("snapshots need a blob store")
            bound = (limits.disk_mb + 64) << 20
            try:
                with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(self.blobs.get(snapshot))) as reader:
                    raw = reader.read(bound + 1)
            except zstandard.ZstdError as e:
                raise SessionError(f"snapshot {snapshot} does not decompress: {e}") from None
            if len(raw) > bound:
                raise SessionError(f"snapshot {snapshot} is larger than the session's work area")
            with tarfile.open(fileobj=io.BytesIO(raw)) as outer:
                for where in ("work", "tmp"):
                    member = outer.extractfile(f"{where}.tar")
                    if member is not None:
                        self._put(container, f"/{where}", member.read())
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
              limits: SessionLimits, client_id: str, client_key: str) -> tuple[Session, str]:
        """Make ``container`` a new session; returns it and its key sealed to ``client_key``."""
        key = auth.new_session_key()
        try:
            sealed = auth.seal(key, client_key)
        except ValueError as e:
            raise SessionError(f"client_key is not an X25519 public key: {e}") from None
        session = self._register(Session(id=uuid.uuid4().hex, key=key, client_id=client_id, image=image,
                                         limits=limits, container=container, volumes=volumes, keeper_pid=keeper,
                                         init_pid=init_pid, procs_file=cgroup_procs(init_pid)))
        if self.blobs is not None:
            self.blobs.set_name(key_name(session.id), key)
        return session, sealed

    def _register(self, session: Session) -> Session:
        with self._lock:
            self.sessions[session.id] = session
        return session

    # --- hand-over between workers (a rebalance moves the session's partition) --------------------------------

    def hand_over(self, session: Session) -> None:
        """Snapshot the session into the blob store with what its next owner needs, then drop it here."""
        if self.blobs is None:
            self.close(session)
            return
        digest, _ = self.snapshot(session)
        with session.lock:
            recent = list(session.results.items())[-256:]
        record = {"image": session.image, "limits": session.limits.model_dump(), "snapshot": digest,
                  "client_id": session.client_id, "forgotten_ms": session.forgotten_ms,
                  "results": [[rid, result.model_dump(mode="json")] for rid, result in recent]}
        self.blobs.set_name(handover_name(session.id), json.dumps(record).encode())
        self.close(session)

    def take_over(self, session_id: str, request_id: str, request: ExecRequest, partition: int) -> Session | None:
        """The session a former owner handed over, restored here (only for a request proven with its key)."""
        if self.blobs is None:
            return None
        try:
            raw = self.blobs.get_name(handover_name(session_id))
            key = self.blobs.get_name(key_name(session_id))
        except BlobNotFound:
            return None
        if not raw:  # already taken over (and lost again)
            return None
        if not auth.verify(key, request_id, request, request.auth):
            raise SessionDenied("the request's proof does not match this session (forged or altered)")
        record = json.loads(raw)
        limits = SessionLimits.model_validate(record["limits"])
        container, volumes, keeper, init_pid = self.create_container(record["image"], limits)
        try:
            self.populate(container, record["image"], record["snapshot"], limits)
        except BaseException:
            self.remove(container, volumes)
            raise
        session = Session(id=session_id, key=key, client_id=record["client_id"], image=record["image"],
                          limits=limits, container=container, volumes=volumes, keeper_pid=keeper, init_pid=init_pid,
                          procs_file=cgroup_procs(init_pid), partition=partition,
                          forgotten_ms=int(record["forgotten_ms"]))
        for rid, result in record["results"]:
            session.results[rid] = ExecResult.model_validate(result)
        self.blobs.set_name(handover_name(session_id), b"")
        return self._register(session)

    def get(self, session_id: str | None, request_id: str, request: ExecRequest) -> Session:
        """The session ``request`` names, if its proof holds."""
        with self._lock:
            session = self.sessions.get(session_id or "")
        if session is None:
            raise SessionLost("unknown session: lost with the worker that held it, expired, or never opened")
        if not auth.verify(session.key, request_id, request, request.auth):
            raise SessionDenied("the request's proof does not match this session (forged or altered)")
        if not self._alive(session):
            self.close(session)
            raise SessionLost(f"session {session.id} lost its container")
        session.last_used = time.monotonic()
        return session

    def check_snapshot(self, request_id: str, request: ExecRequest) -> None:
        """Opening from a snapshot: only with the proof of the session that took it."""
        if self.blobs is None or request.snapshot is None or request.snapshot_session is None:
            raise SessionDenied("opening from a snapshot needs the proof of the session that took it")
        try:
            self.blobs.get_name(snapshot_name(request.snapshot, request.snapshot_session))
            key = self.blobs.get_name(key_name(request.snapshot_session))
        except BlobNotFound:
            raise SessionDenied("that session did not take this snapshot") from None
        if not auth.verify(key, request_id, request, request.snapshot_auth):
            raise SessionDenied("the snapshot proof does not match the session that took it")

    def _alive(self, session: Session) -> bool:
        """Whether the container still runs; a Docker hiccup is an infrastructure error, not a lost session."""
        try:
            session.container.reload()
        except NotFound:
            return False
        except (APIError, DockerException) as e:
            raise InfraError(f"inspecting session {session.id}: {e}") from e
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
            wrapper = f"timeout -s KILL {timeout_s:g} bash -c {shlex.quote(command)}"
            exec_id = self.client.api.exec_create(session.container.id, ["bash", "-c", wrapper], user="1000:1000",
                                                  workdir="/work", environment={"HOME": "/tmp", **(env or {})})["Id"]
            stream = self.client.api.exec_start(exec_id, stream=True, demux=True)
        except (APIError, DockerException) as e:
            raise InfraError(f"exec in session {session.id}: {e}") from e
        # The command may have killed its own wrapper: past its limit its processes are killed from outside.
        watchdog = threading.Timer(timeout_s + 5.0, self.sweep, args=(session,))
        watchdog.daemon = True
        watchdog.start()
        try:
            out, err, out_cut, err_cut = _read_capped(stream, cap)
        finally:
            watchdog.cancel()
        code = self.client.api.exec_inspect(exec_id).get("ExitCode")
        elapsed = time.monotonic() - started
        self.sweep(session)
        timed_out = code == 137 and elapsed >= timeout_s * 0.95
        return CommandOutput(exit_code=code, stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                             stdout_truncated=out_cut, stderr_truncated=err_cut, timed_out=timed_out,
                             duration_s=round(elapsed, 4))

    def _pids(self, session: Session) -> set[int]:
        if session.procs_file is not None:
            with contextlib.suppress(OSError, ValueError):
                return {int(p) for p in session.procs_file.read_text().split()}
        try:
            return {int(row[0]) for row in session.container.top(ps_args="-eo pid")["Processes"]}
        except (APIError, DockerException):
            return set()

    def sweep(self, session: Session) -> int:
        """SIGKILL, from outside (host pids of the container's cgroup), everything but the init and the keeper,
        until nothing else is left: whatever a command started ends with it."""
        killed = 0
        for attempt in range(50):
            strays = self._pids(session) - {session.init_pid, session.keeper_pid}
            if not strays:
                return killed
            for pid in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
                except PermissionError:  # a worker without the right to signal them: uid 1000 does it
                    self._exec_io(session, ["bash", "-c", "kill -9 -1"], None)
            time.sleep(0.002 * attempt)
        raise InfraError(f"session {session.id}: processes survive SIGKILL")

    def _exec_io(self, session: Session, argv: list[str], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        """One process as uid 1000 in the session, ``stdin`` fed in full; returns (exit code, stdout, stderr)."""
        api = self.client.api
        try:
            exec_id = api.exec_create(session.container.id, argv, stdin=stdin is not None, user="1000:1000",
                                      workdir="/work", environment={"HOME": "/tmp"})["Id"]
            if stdin is None:
                out, err = api.exec_start(exec_id, demux=True)
            else:
                sock = api.exec_start(exec_id, socket=True)
                raw = getattr(sock, "_sock", sock)
                try:
                    raw.sendall(stdin)
                    raw.shutdown(socket.SHUT_WR)
                    frames = (demux_adaptor(*frame) for frame in frames_iter(sock, tty=False))
                    out, err = consume_socket_output(frames, demux=True)
                finally:
                    sock.close()
            code = int(api.exec_inspect(exec_id).get("ExitCode") or 0)
        except (APIError, DockerException, OSError) as e:
            raise InfraError(f"file transfer in session {session.id}: {e}") from e
        return code, out or b"", err or b""

    def write_files(self, session: Session, files: list[FileContent]) -> None:
        entries = []
        for f in files:
            data = f.text.encode() if f.text is not None else base64.b64decode(f.content_b64 or "", validate=True)
            entries.append((safe_path(f.path), data, f.mode))
        code, _, err = self._exec_io(session, ["bash", "-c", _WRITE, "kiln-write", *(e[0] for e in entries)],
                                     _tar(entries))
        self.sweep(session)
        if code != 0:
            raise SessionError(f"writing files failed: {err.decode(errors='replace').strip()[-500:]}")

    def read_files(self, session: Session, paths: list[str]) -> list[FileContent]:
        """All ``paths`` in one archive, read as uid 1000; none may resolve outside /work."""
        rels = [safe_path(p) for p in paths]
        if not rels:
            return []
        code, data, err = self._exec_io(session, ["bash", "-c", _READ, "kiln-read", *rels], None)
        self.sweep(session)
        if code != 0:
            raise SessionError(err.decode(errors="replace").strip()[-500:] or f"reading files failed ({code})")
        contents: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar:
                extracted = tar.extractfile(member) if member.isfile() else None
                if extracted is not None:
                    contents[member.name] = extracted.read()
        out = []
        for rel in rels:
            raw = contents.get(rel, b"")
            try:
                out.append(FileContent(path=rel, text=raw.decode()))
            except UnicodeDecodeError:
                out.append(FileContent(path=rel, content_b64=base64.b64encode(raw).decode()))
        return out

    def _put(self, container: Any, where: str, data: bytes) -> None:
        """kiln's own bytes into kiln's own areas (a snapshot's tars, a patch file)."""
        try:
            container.put_archive(where, data)
        except (APIError, DockerException) as e:
            raise SessionError(f"writing into the session failed (work area full?): {e}") from e

    def put_tmp(self, session: Session, name: str, data: bytes) -> str:
        """``data`` as a fresh file in /tmp (written as uid 1000, like any session file)."""
        code, _, err = self._exec_io(session, ["bash", "-c", f"cat > /tmp/{shlex.quote(name)}"], data)
        if code != 0:
            raise SessionError(f"writing /tmp/{name} failed: {err.decode(errors='replace')[-300:]}")
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
        digest = self.blobs.put(packed).digest
        self.blobs.set_name(snapshot_name(digest, session.id), b"")  # who may open it: this session's key holder
        return digest, len(packed)
