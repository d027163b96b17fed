"""Exec sessions: one isolated container per session, on this worker's Docker engine.

A session container runs the image read-only, without network, capabilities or new privileges, with CPU/memory/pids
limits and an init (the sandbox policy's ``SESSION`` profile, ``workers/common/sandbox.py``); its only writable places
are two size-limited tmpfs volumes, ``/work`` (populated with the image's ``/work`` or a snapshot) and ``/tmp``, so
snapshots capture all state. Every command runs as uid 1000 through ``docker exec`` under ``timeout -s KILL``. When it
returns, kiln empties the container *from outside*: it reads the container's cgroup (host pids) and SIGKILLs
everything but the init and the idle keeper (capability-less root, which uid 1000 cannot signal) until nothing else is
left. The command cannot defeat that (killing its own wrapper, setsid, fork bombs, SIGTERM-ignorers): nothing it
starts outlives it, so nothing can touch the next command's files or reports. File reads and writes run as uid 1000
inside the container too (one ``tar`` each) and refuse any path that resolves outside ``/work``; Docker's archive API
(root, follows symlinks, ignores the read-only root and the disk limit) is used only on kiln's own areas.

Nothing an image declares changes that: a path it declares a ``VOLUME`` gets a read-only empty tmpfs (outside
``/work`` and ``/tmp``) or a size-limited tmpfs volume carved out of the session's disk budget (inside them), so
Docker creates no anonymous volume. Its ``LABEL``s, which Docker merges into its containers' labels, can imitate
kiln's (``kiln.role``, ``kiln.worker``, ``kiln.lock``): the labels kiln sets on its containers carry a seal
(``LabelSeal``), and the reaper judges only what a seal covers.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import io
import json
import os
import posixpath
import secrets
import shlex
import signal
import socket
import stat
import tarfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard
from docker.errors import APIError, DockerException, NotFound
from docker.types import Mount
from docker.utils.socket import STDERR, frames_iter

from kiln.schemas.envelope import request_id_value
from kiln.schemas.exec import CommandOutput, ExecRequest, ExecResult, FileContent, SessionLimits
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import BlobNotFound, ConfigError, InfraError
from kiln.workers.common import sandbox
from kiln.workers.common.containers import untar_files
from kiln.workers.common.sandbox import Limits
from kiln.workers.exec import auth
from kiln.workers.exec.errors import SessionDenied, SessionError, SessionLost
from kiln.workers.exec.metrics import KILLS

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


REPLAY_WINDOW = 4096  # results remembered per session for replayed request ids
REPLAY_BYTES = 16 << 20  # ... and their size (``KILN_EXEC_REPLAY_CACHE_BYTES``)
HANDOVER_RESULTS = 256  # results a hand-over carries to the next owner
MAX_IMAGE_VOLUMES = 64  # paths an image may declare as volumes


def result_bytes(result: ExecResult) -> int:
    """What a remembered result weighs: its JSON form (the form a hand-over stores too)."""
    return len(result.model_dump_json())


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
    # Replays: request id -> first result; ids at or below the forgotten watermark (a ULID's number) are refused.
    # Bounded by count (REPLAY_WINDOW) and bytes (max_bytes); every result forgotten raises the watermark to its id.
    results: OrderedDict[str, ExecResult] = field(default_factory=OrderedDict)
    forgotten: int = 0
    max_bytes: int = REPLAY_BYTES
    cached_bytes: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    trim: Callable[[Session], None] | None = None  # the worker's bound across its sessions, set on registering

    def answered(self, request_id: str) -> ExecResult | None:
        """The first result of ``request_id`` if it ran here; SessionDenied if it is too old to tell."""
        if request_id in self.results:
            return self.results[request_id]
        value = request_id_value(request_id)
        if value is None:
            raise SessionDenied("session requests need ULID request ids (replays are judged by their time)")
        if value <= self.forgotten:
            raise SessionDenied(f"request id {request_id} is older than this session's replay window")
        return None

    def remember(self, request_id: str, result: ExecResult) -> None:
        """Keep ``result`` for replays of ``request_id``; past the count or byte bound the oldest are forgotten
        (the result just kept too, when it alone is larger than the bound: a replay of it is then refused)."""
        if request_id in self.results:
            return
        size = result_bytes(result)
        self.results[request_id] = result
        self.sizes[request_id] = size
        self.cached_bytes += size
        while self.results and (len(self.results) > REPLAY_WINDOW or self.cached_bytes > self.max_bytes):
            self.forget_oldest()
        if self.trim is not None:
            self.trim(self)

    def forget_oldest(self) -> int:
        """Drop the oldest remembered result, raising the watermark to its id's time; returns the bytes freed."""
        if not self.results:
            return 0
        old, _ = self.results.popitem(last=False)
        size = self.sizes.pop(old, 0)
        self.cached_bytes -= size
        self.forgotten = max(self.forgotten, request_id_value(old) or 0)
        return size

    def handover_state(self, keep: int = HANDOVER_RESULTS) -> tuple[int, list[tuple[str, ExecResult]]]:
        """What the next owner needs to answer replays: the newest ``keep`` results, and a watermark at or above
        every id *not* carried (those forgotten before, and those left behind now), so a request id runs at most
        once whichever worker holds the session."""
        items = list(self.results.items())
        carried = items[-keep:] if keep > 0 else []
        dropped = items[:len(items) - len(carried)]
        forgotten = max([self.forgotten, *((request_id_value(rid) or 0) for rid, _ in dropped)])
        return forgotten, carried


SEAL = "kiln.seal"
SEALED = "kiln.sealed"
SEAL_FILE = ".kiln-seal-key"


class LabelSeal:
    """kiln's mark on the containers it creates. Docker merges an image's ``LABEL``s into the labels of every
    container of it, so a label alone proves nothing: any image can claim ``kiln.role=exec-session``, a lock path,
    a worker id. kiln sets its own labels explicitly when it creates a container (they override an image's labels
    of the same keys) and adds ``kiln.sealed`` (the keys it set) and ``kiln.seal``: an HMAC-SHA256, under a secret
    of this host, over the container's name and those labels. An image cannot compute it, nor reuse a seal it saw
    (another name). Only labels a seal covers are kiln's."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ConfigError("a label seal needs a key of at least 32 bytes")
        self._key = key

    @classmethod
    def load(cls, lock_dir: Path) -> LabelSeal:
        """The host's secret, ``lock_dir/.kiln-seal-key``: made once (0600, by the first worker; the link makes the
        first one win a race), then read by every worker of the host. A file that is not a regular file of this uid
        readable only by it is refused."""
        lock_dir.mkdir(parents=True, exist_ok=True)
        path = lock_dir / SEAL_FILE
        for _ in range(3):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                draft = lock_dir / f"{SEAL_FILE}.{os.getpid()}.{uuid.uuid4().hex}"
                with os.fdopen(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600),
                               "wb") as out:
                    out.write(secrets.token_bytes(32))
                try:
                    os.link(draft, path)
                except FileExistsError:
                    pass
                finally:
                    draft.unlink()
                continue
            except OSError as e:
                raise ConfigError(f"the exec label seal {path} cannot be opened: {e}") from e
            with os.fdopen(fd, "rb") as f:
                info = os.fstat(f.fileno())
                key = f.read(64)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise ConfigError(f"the exec label seal {path} must be a regular file of uid {os.geteuid()}, "
                                  "mode 0600")
            return cls(key)
        raise ConfigError(f"the exec label seal {path} could not be created")

    def _mac(self, name: str, labels: Mapping[str, str], keys: list[str]) -> str:
        body = json.dumps([name, [[k, labels.get(k)] for k in keys]], separators=(",", ":"))
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()

    def seal(self, name: str, labels: Mapping[str, str]) -> dict[str, str]:
        """``labels`` plus the seal binding them to the container named ``name``."""
        own = {k: v for k, v in labels.items() if k not in (SEAL, SEALED)}
        keys = sorted(own)
        if any("," in k for k in keys):
            raise ValueError("sealed label keys cannot contain ','")
        return {**own, SEALED: ",".join(keys), SEAL: self._mac(name, own, keys)}

    def recorded(self, name: str, labels: Mapping[str, str]) -> dict[str, str] | None:
        """The labels kiln set on container ``name`` (only those its seal covers), or None without a valid seal."""
        mac, listed = labels.get(SEAL), labels.get(SEALED)
        if not mac or not listed:
            return None
        keys = listed.split(",")
        if keys != sorted(set(keys)) or any(k not in labels for k in keys):
            return None
        if not hmac.compare_digest(mac, self._mac(name, labels, keys)):
            return None
        return {k: labels[k] for k in keys}

    def holds(self, name: str, labels: Mapping[str, str]) -> bool:
        return self.recorded(name, labels) is not None


def image_volumes(client: Any, image: str) -> list[str]:
    """The paths ``image`` declares as volumes (its config's ``Volumes``), normalised."""
    try:
        config = client.images.get(image).attrs.get("Config") or {}
    except (APIError, DockerException) as e:
        raise InfraError(f"inspecting image {image}: {e}") from e
    paths = sorted({posixpath.normpath("/" + str(p).strip("/")) for p in (config.get("Volumes") or {})})
    if len(paths) > MAX_IMAGE_VOLUMES:
        raise SessionError(f"image {image} declares {len(paths)} volumes (at most {MAX_IMAGE_VOLUMES})")
    return paths


def _forgotten(record: dict[str, Any]) -> int:
    """A hand-over record's watermark; one without the id's number (an earlier worker) covers its whole ms."""
    if "forgotten" in record:
        return int(record["forgotten"])
    return ((int(record["forgotten_ms"]) + 1) << 80) - 1


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


PF_EXITING = 0x4  # a task's flag (linux/sched.h) from the moment it begins to exit


def pid_running(pid: int) -> bool:
    """Whether host pid ``pid`` is a live process: not gone, not a zombie, not exiting. (A container's init killed
    stays in its exit until the kernel has ended every other process of the container: already exiting, still
    listed as sleeping.)"""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except (OSError, IndexError, ValueError):
        return False
    return state not in ("Z", "X") and not flags & PF_EXITING


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


class EndMark:
    """A fresh mark the wrapper prints on stdout and stderr after the command has ended. dockerd gives an exec's
    output at most 2 s past the process's exit, then closes its streams with whatever has not reached the reader yet
    (moby#27289, docker-py#2042: a quick process under load, or a reader that stalls while the output is in flight),
    and a cut stream reads exactly like a command that printed less. So the wrapper does not exit until the reader
    has seen its mark on both streams and closed the wrapper's stdin: the exit comes after the output, never before.
    A stream whose mark did not arrive was cut."""

    def __init__(self) -> None:
        self.mark = f"\x1ekiln-end:{secrets.token_hex(8)}\x1e".encode()

    def wrap(self, script: str, stdin_bytes: int | None = None) -> str:
        """``script`` (its ``exit`` and ``exec`` included: it runs in a subshell) with the first ``stdin_bytes`` of
        the wrapper's stdin as its own (None: /dev/null), then the mark on both streams, then -- at the end of the
        wrapper's stdin, which only the reader can close -- the script's exit status. A mark is written again until
        it goes through: a command may leave its streams non-blocking (as Node does) with the pipe full."""
        mark = shlex.quote(self.mark.decode())
        feed = "</dev/null" if stdin_bytes is None else ""
        head = "" if stdin_bytes is None else f"head -c {stdin_bytes} | "
        wait = "do read -r -t 0.01 -N 1 kiln_ack; done"
        return (f"{head}(\n{script}\n) {feed}\nrc=$?\n"
                f"until printf %s {mark} 2>/dev/null; {wait}\n"
                f"until printf %s {mark} >&2 2>/dev/null; {wait}\n"
                "while read -r -N 4096 kiln_ack; do :; done\nexit $rc")


class Capture:
    """One stream as it arrives: its first ``cap`` bytes kept without the mark, its length counted, and where the
    mark's last copy fell (the wrapper prints it after the command, so a copy the command printed comes earlier and
    stays in its output; what a leftover process prints after the mark stays too)."""

    def __init__(self, cap: int, mark: bytes) -> None:
        self.cap, self.mark = cap, mark
        self.head = bytearray()
        self.length = 0
        self.at: int | None = None
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        window = self._carry + chunk
        found = window.rfind(self.mark)
        if found >= 0:
            self.at = self.length - len(self._carry) + found
        room = self.cap + len(self.mark) - len(self.head)
        if room > 0:
            self.head += chunk[:room]
        self.length += len(chunk)
        self._carry = window[-(len(self.mark) - 1):]

    @property
    def ended(self) -> bool:
        return self.at is not None

    def output(self) -> tuple[bytes, bool]:
        """(the stream without the mark, its first ``cap`` bytes; whether it was longer)."""
        data, length = bytes(self.head), self.length
        if self.at is not None:
            data = data[:self.at] + data[self.at + len(self.mark):]
            length -= len(self.mark)
        return data[:self.cap], length > self.cap


def cut_by_dockerd(code: int | None, *captures: Capture) -> bool:
    """A mark missing while the wrapper exited on its own (a status below 128): the stream lost output the command
    printed. A wrapper killed by a signal (the command may kill its own wrapper) never printed the mark: that answer
    stands as it arrived — a command cannot turn its own failure into an infrastructure one."""
    return code is not None and code < 128 and not all(c.ended for c in captures)


class SessionManager:
    def __init__(self, client: Any, worker_id: str, blobs: BlobStore | None, image_prefixes: list[str],
                 labels: dict[str, str] | None = None, seal: LabelSeal | None = None,
                 replay_bytes: int = REPLAY_BYTES, replay_total_bytes: int = 16 * REPLAY_BYTES) -> None:
        self.client = client
        self.worker_id = worker_id
        self.labels = {"kiln.role": ROLE, "kiln.worker": worker_id, **(labels or {})}
        # Without the host's seal (a manager outside a worker), one of this process: only it knows its containers.
        self.seal = seal if seal is not None else LabelSeal(secrets.token_bytes(32))
        self.blobs = blobs
        self.image_prefixes = image_prefixes
        self.replay_bytes = replay_bytes
        self.replay_total_bytes = replay_total_bytes
        self.sessions: dict[str, Session] = {}
        self._work_tars: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def sealed_labels(self, name: str, labels: dict[str, str] | None = None) -> dict[str, str]:
        """The labels to create the container named ``name`` with: this worker's (role, worker, lock, namespace),
        then ``labels``, all sealed to ``name`` -- the only labels the reaper trusts."""
        return self.seal.seal(name, {**self.labels, **(labels or {})})

    def seal_holds(self, name: str, labels: Mapping[str, str]) -> bool:
        """Whether container ``name``'s ``labels`` carry a seal made with this host's secret."""
        return self.seal.holds(name, labels)

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def check_image(self, image: str) -> None:
        if not any(image.startswith(p) for p in self.image_prefixes):
            raise SessionError(f"image {image!r} is not allowed (allowed prefixes: {', '.join(self.image_prefixes)})")

    def create_container(self, image: str, limits: SessionLimits) -> tuple[Any, list[str], int, int]:
        """A running, empty-workspace container for ``image``; returns it, its volumes, keeper and init host pids."""
        name = f"kiln-x-{uuid.uuid4().hex[:16]}"
        areas, mounts = self.volume_plan(image, limits.disk_mb)
        volumes: list[str] = []
        try:
            binds = {}
            for where, path, size in areas:
                volumes.append(sandbox.tmpfs_volume(self.client, f"{name}-{where}", size << 20, ROLE))
                binds[volumes[-1]] = {"bind": path, "mode": "rw"}
            container = sandbox.create(
                self.client, image, ["sleep", "infinity"], profile=sandbox.SESSION, limits=Limits.of_session(limits),
                start=True, name=name, volumes=binds, mounts=mounts, working_dir="/work",
                labels=self.sealed_labels(name), environment={"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"})
            container.reload()
            init_pid = int(container.attrs["State"]["Pid"])
            keeper = self._keeper(container, init_pid)
        except (APIError, DockerException) as e:
            self.remove(None, volumes)
            raise InfraError(f"starting a session container from {image}: {e}") from e
        return container, volumes, keeper, init_pid

    def volume_plan(self, image: str, disk_mb: int) -> tuple[list[tuple[str, str, int]], list[Mount]]:
        """Where a session's writable areas go: (volume suffix, path, MiB) for ``/work``, ``/tmp`` and every path
        the image declares a volume inside them -- all tmpfs volumes sharing the disk budget -- and a read-only
        empty tmpfs on every other declared path. Docker then creates no anonymous volume (it would be writable,
        unbounded, and left behind)."""
        declared = [p for p in image_volumes(self.client, image) if p not in ("/work", "/tmp")]
        inside = [p for p in declared if p.startswith(("/work/", "/tmp/"))]
        share = max(4, disk_mb // 2) if not inside else disk_mb // (2 + len(inside))
        if share < 4:
            raise SessionError(f"image {image} declares {len(inside)} volumes under /work and /tmp: more than "
                               f"a {disk_mb} MiB work area can share")
        areas = [("work", "/work", share), ("tmp", "/tmp", share)]
        areas += [(f"v{i}", path, share) for i, path in enumerate(inside)]
        mounts = [Mount(target=path, source=None, type="tmpfs", read_only=True, tmpfs_size=64 << 10)
                  for path in declared if path not in inside]
        return areas, mounts

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
        content = self.image_work(image)
        if content:
            container.put_archive("/work", content)

    def image_work(self, image: str) -> bytes:
        """The image's /work as a tar, read once per image id (an image without /work gives an empty area)."""
        image_id = str(self.client.images.get(image).id)
        with self._lock:
            cached = self._work_tars.get(image_id)
        if cached is not None:
            return cached
        # Never started; its anonymous volumes (paths the image declares) go with it.
        source = sandbox.create(self.client, image, ["true"], profile=sandbox.IMAGE_FILES, limits=Limits())
        try:
            stream, _ = source.get_archive("/work/.")
            content = b"".join(stream)
        except NotFound:
            content = b""
        finally:
            source.remove(force=True, v=True)
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
                                         init_pid=init_pid, procs_file=cgroup_procs(init_pid),
                                         max_bytes=self.replay_bytes))
        if self.blobs is not None:
            self.blobs.set_name(key_name(session.id), key)
        return session, sealed

    def _register(self, session: Session) -> Session:
        with self._lock:
            self.sessions[session.id] = session
        session.trim = self._trim_replays
        self._trim_replays(session)
        return session

    def replay_bytes_held(self) -> int:
        with self._lock:
            return sum(s.cached_bytes for s in self.sessions.values())

    def _trim_replays(self, current: Session) -> None:
        """Keep the replay caches of all sessions under ``replay_total_bytes``: the largest forgets its oldest
        first. ``current``'s lock is held by the caller; another session's is taken."""
        with self._lock:
            sessions = list(self.sessions.values())
        total = sum(s.cached_bytes for s in sessions)
        while total > self.replay_total_bytes:
            largest = max(sessions, key=lambda s: s.cached_bytes)
            if largest.cached_bytes <= 0:
                return
            with contextlib.nullcontext() if largest is current else largest.lock:
                freed = largest.forget_oldest()
            total -= freed

    # --- hand-over between workers (a rebalance moves the session's partition) --------------------------------

    def hand_over(self, session: Session) -> None:
        """Snapshot the session into the blob store with what its next owner needs, then drop it here."""
        if self.blobs is None:
            self.close(session)
            return
        digest, _ = self.snapshot(session)
        with session.lock:
            forgotten, recent = session.handover_state()
        record = {"image": session.image, "limits": session.limits.model_dump(), "snapshot": digest,
                  "client_id": session.client_id, "forgotten": str(forgotten), "forgotten_ms": forgotten >> 80,
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
                          forgotten=_forgotten(record), max_bytes=self.replay_bytes)
        for rid, result in record["results"]:  # within this worker's bounds (forgetting raises the watermark)
            session.remember(rid, ExecResult.model_validate(result))
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
        self._check_alive(session)
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
        """Whether the container still runs; a Docker hiccup is an infrastructure error, not a lost session. Where
        this worker sees the host's pids (it read the container's cgroup), its init is asked first: a container
        being killed ends its processes (a command's stream with them) before Docker's state says so."""
        if session.procs_file is not None and not pid_running(session.init_pid):
            return False
        try:
            session.container.reload()
        except NotFound:
            return False
        except (APIError, DockerException) as e:
            raise InfraError(f"inspecting session {session.id}: {e}") from e
        return bool(session.container.status == "running")

    def _check_alive(self, session: Session) -> None:
        """SessionLost (and the session closed here) once its container is gone or stopped: removed by a reaper,
        killed with its engine. Never the command's doing: it cannot signal the container's init or keeper."""
        if not self._alive(session):
            self.close(session)
            raise SessionLost(f"session {session.id} lost its container")

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
        # The command may have killed its own wrapper: past its limit its processes are killed from outside.
        watchdog = threading.Timer(timeout_s + 5.0, self._sweep_overdue, args=(session,))
        watchdog.daemon = True
        watchdog.start()
        script = f"timeout -s KILL {timeout_s:g} bash -c {shlex.quote(command)}"
        try:
            code, stdout, stderr = self._marked(session, script, [], None, (cap, cap), env or {}, "exec")
        finally:
            watchdog.cancel()
        elapsed = time.monotonic() - started
        killed = self.sweep(session)
        if cut_by_dockerd(code, stdout, stderr):
            raise InfraError(f"session {session.id}: dockerd closed the command's output stream early")
        timed_out = code == 137 and elapsed >= timeout_s * 0.95
        if timed_out:
            KILLS.inc(killed)
        (out, out_cut), (err, err_cut) = stdout.output(), stderr.output()
        return CommandOutput(exit_code=code, stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                             stdout_truncated=out_cut, stderr_truncated=err_cut, timed_out=timed_out,
                             duration_s=round(elapsed, 4))

    def _marked(self, session: Session, script: str, args: list[str], stdin: bytes | None, caps: tuple[int, int],
                env: dict[str, str], what: str) -> tuple[int | None, Capture, Capture]:
        """``script`` run by bash as uid 1000 in the session with ``args`` as its arguments and ``stdin`` fed in
        full (``EndMark.wrap``); returns its exit status and its streams (the first ``caps`` bytes of each). The
        wrapper's stdin is closed once both marks have arrived, so it exits only after its output was read. A
        container gone or stopped under it is a lost session; any other Docker failure an infrastructure one."""
        api = self.client.api
        end = EndMark()
        out, err = Capture(caps[0], end.mark), Capture(caps[1], end.mark)
        try:
            exec_id = api.exec_create(session.container.id,
                                      ["bash", "-c", end.wrap(script, None if stdin is None else len(stdin)),
                                       "kiln", *args], stdin=True, user="1000:1000", workdir="/work",
                                      environment={"HOME": "/tmp", **env})["Id"]
            sock = api.exec_start(exec_id, socket=True)
            raw = getattr(sock, "_sock", sock)
            try:
                if stdin:
                    raw.sendall(stdin)
                acked = False
                for stream, payload in frames_iter(sock, tty=False):
                    (err if stream == STDERR else out).feed(payload)
                    if not acked and out.ended and err.ended:
                        raw.shutdown(socket.SHUT_WR)  # the wrapper's stdin ends: it may exit now
                        acked = True
            finally:
                sock.close()
            code = api.exec_inspect(exec_id).get("ExitCode")
        except (APIError, DockerException, OSError) as e:
            self._check_alive(session)
            raise InfraError(f"{what} in session {session.id}: {e}") from e
        if not (out.ended and err.ended):  # killed, or cut: perhaps with its container
            self._check_alive(session)
        return code, out, err

    def _pids(self, session: Session) -> set[int]:
        if session.procs_file is not None:
            with contextlib.suppress(OSError, ValueError):
                return {int(p) for p in session.procs_file.read_text().split()}
        try:
            return {int(row[0]) for row in session.container.top(ps_args="-eo pid")["Processes"]}
        except (APIError, DockerException):
            return set()

    def _sweep_overdue(self, session: Session) -> None:
        """(The watchdog of a command past its limit.) Its processes killed by host pid, and counted."""
        KILLS.inc(self.sweep(session))

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
                    self._exec_io(session, "kill -9 -1", [], None)
            time.sleep(0.002 * attempt)
        raise InfraError(f"session {session.id}: processes survive SIGKILL")

    def _exec_io(self, session: Session, script: str, args: list[str], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        """``script`` run by bash as uid 1000 in the session with ``args`` as its arguments, ``stdin`` fed in full;
        returns (exit code, stdout, stderr)."""
        code, stdout, stderr = self._marked(session, script, args, stdin, (MAX_READ_TOTAL << 1, MAX_READ_TOTAL), {},
                                            "file transfer")
        if cut_by_dockerd(code, stdout, stderr):
            raise InfraError(f"file transfer in session {session.id}: dockerd closed its output stream early")
        return int(code or 0), stdout.output()[0], stderr.output()[0]

    def write_files(self, session: Session, files: list[FileContent]) -> None:
        entries = []
        for f in files:
            data = f.text.encode() if f.text is not None else base64.b64decode(f.content_b64 or "", validate=True)
            entries.append((safe_path(f.path), data, f.mode))
        code, _, err = self._exec_io(session, _WRITE, [e[0] for e in entries], _tar(entries))
        self.sweep(session)
        if code != 0:
            raise SessionError(f"writing files failed: {err.decode(errors='replace').strip()[-500:]}")

    def read_files(self, session: Session, paths: list[str]) -> list[FileContent]:
        """All ``paths`` in one archive, read as uid 1000; none may resolve outside /work."""
        rels = [safe_path(p) for p in paths]
        if not rels:
            return []
        code, data, err = self._exec_io(session, _READ, rels, None)
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
        code, _, err = self._exec_io(session, f"cat > /tmp/{shlex.quote(name)}", [], data)
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
