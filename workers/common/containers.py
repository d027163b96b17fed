"""Running untrusted code in containers through the Docker SDK, in containers the sandbox policy makes (``sandbox.py``:
no network, non-root, bounded CPU, memory and pids, no new privileges, every capability dropped), bounded in time
too; files come back as a tar of one directory. Shared by the stages that run repository code (builder, exec).

What such code prints or leaves behind is read as a stream and never past a cap (``Limits.output_bytes``: the tail
of the output is kept; ``Limits.collect_bytes``: a larger collected directory is not read at all), so the
worker's memory is bounded by configuration, not by the code under test; the engine itself keeps no more than a
few times ``output_bytes`` of a container's log on disk (json-file ``max-size``, ``max-file``)."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import time
from dataclasses import dataclass, field
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound

from kiln.streams import cancel
from kiln.streams.errors import DockerUnavailable, InfraError
from kiln.workers.common import sandbox
from kiln.workers.common.sandbox import Limits as Limits  # the one limits type, where its users always found it

LABEL = "kiln.role"


class OutputTail:
    """The last ``cap`` bytes of a stream fed in chunks, and how many bytes before them were dropped."""

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self.buffer = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes | str) -> None:
        self.buffer += chunk.encode() if isinstance(chunk, str) else chunk
        if len(self.buffer) > 2 * self.cap:  # trimmed in batches: each byte is moved a bounded number of times
            cut = len(self.buffer) - self.cap
            del self.buffer[:cut]
            self.dropped += cut

    def text(self) -> str:
        kept = bytes(self.buffer[-self.cap:])
        dropped = self.dropped + len(self.buffer) - len(kept)
        note = f"[kiln: {dropped} earlier bytes of output dropped]\n" if dropped else ""
        return note + kept.decode(errors="replace")


def read_capped(chunks: Any, cap: int) -> bytes | None:
    """The concatenated ``chunks``, or None as soon as they pass ``cap`` bytes (the rest is not read: the stream is
    closed, which lets its HTTP response go, so the engine stops sending and can remove the container)."""
    data = bytearray()
    for chunk in chunks:
        data += chunk
        if len(data) > cap:
            with contextlib.suppress(AttributeError):
                chunks.close()
            return None
    return bytes(data)


@dataclass
class RunResult:
    exit_code: int | None
    output: str
    timed_out: bool
    seconds: float
    files: dict[str, bytes] = field(default_factory=dict)


def docker_client(timeout_s: float = 600.0) -> Any:
    try:
        return docker.from_env(timeout=int(timeout_s))
    except DockerException as e:
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise DockerUnavailable(f"Docker is not reachable at {host}: {e}") from e


def untar_files(data: bytes) -> dict[str, bytes]:
    """The regular files of a ``get_archive`` tar, by path below the archived directory."""
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                extracted = tar.extractfile(member)
                if extracted is not None:
                    files[member.name.split("/", 1)[-1]] = extracted.read()
    return files


def exec_capped(container: Any, command: list[str], cap: int, *, workdir: str | None = None, user: str = "",
                environment: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``command`` in a running container; (exit code, the last ``cap`` bytes of its stdout+stderr), read as a
    stream (``exec_run`` would hold all of it)."""
    api = container.client.api
    exec_id = api.exec_create(container.id, command, user=user, workdir=workdir, environment=environment)["Id"]
    tail = OutputTail(cap)
    for chunk in api.exec_start(exec_id, stream=True):
        tail.add(chunk)
    code = api.exec_inspect(exec_id).get("ExitCode")
    return (-1 if code is None else int(code)), tail.text()


def kill_on_cancel(container: Any) -> None:
    """When the running job is given up, kill ``container`` (what waits on it then returns; see streams/cancel.py)."""
    def kill() -> None:
        with contextlib.suppress(APIError, DockerException):
            container.kill()

    cancel.on_cancel(kill)


def run_sandboxed(client: Any, image: str, script: str, *, limits: Limits, role: str, collect: str | None = None,
                  env: dict[str, str] | None = None, workdir: str | None = None,
                  cgroup_parent: str | None = None) -> RunResult:
    """Run ``bash -c script`` in a fresh networkless container; collect the directory ``collect`` afterwards."""
    started = time.monotonic()
    try:
        container = sandbox.create(client, image, ["bash", "-c", script], profile=sandbox.TEST_RUN, limits=limits,
                                   labels={LABEL: role}, environment=env, working_dir=workdir,
                                   cgroup_parent=cgroup_parent)
    except (APIError, DockerException) as e:
        raise InfraError(f"creating a container from {image}: {e}") from e
    kill_on_cancel(container)
    timed_out = False
    try:
        container.start()
        try:
            status = container.wait(timeout=limits.timeout_s)
            code: int | None = int(status.get("StatusCode", -1))
        except Exception:  # the wait timed out (requests raises its own timeout types)
            timed_out, code = True, None
            container.kill()
        tail = OutputTail(limits.output_bytes)
        for chunk in container.logs(stdout=True, stderr=True, stream=True, follow=False):
            tail.add(chunk)
        output = tail.text()
        files: dict[str, bytes] = {}
        if collect:
            try:
                stream, _ = container.get_archive(collect)
                archive = read_capped(stream, limits.collect_bytes)
                if archive is None:
                    output = f"[kiln: {collect} holds more than {limits.collect_bytes} bytes: not read]\n{output}"
                else:
                    files = untar_files(archive)
            except NotFound:
                files = {}
        return RunResult(code, output, timed_out, time.monotonic() - started, files)
    except (APIError, DockerException) as e:
        raise InfraError(f"running a container from {image}: {e}") from e
    finally:
        with contextlib.suppress(APIError, DockerException):
            container.remove(force=True)
