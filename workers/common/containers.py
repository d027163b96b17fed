"""Running untrusted code in containers through the Docker SDK: no network, non-root, bounded CPU, memory, pids and
time, no new privileges, every capability dropped; files come back as a tar of one directory. Shared by the stages
that run repository code (builder, exec)."""

from __future__ import annotations

import contextlib
import io
import tarfile
import time
from dataclasses import dataclass, field
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound

from kiln.streams import cancel
from kiln.streams.errors import InfraError

LABEL = "kiln.role"


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 2 << 30
    cpus: float = 2.0
    pids: int = 1024
    timeout_s: float = 600.0
    user: str = "1000:1000"


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
        raise InfraError(f"Docker is not reachable: {e}") from e


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


def kill_on_cancel(container: Any) -> None:
    """When the running job is given up, kill ``container`` (what waits on it then returns; see streams/cancel.py)."""
    def kill() -> None:
        with contextlib.suppress(APIError, DockerException):
            container.kill()

    cancel.on_cancel(kill)


def run_sandboxed(client: Any, image: str, script: str, *, limits: Limits, role: str, collect: str | None = None,
                  env: dict[str, str] | None = None, workdir: str | None = None) -> RunResult:
    """Run ``bash -c script`` in a fresh networkless container; collect the directory ``collect`` afterwards."""
    started = time.monotonic()
    try:
        container = client.containers.create(
            image, ["bash", "-c", script], network_mode="none", user=limits.user, environment=env or {},
            working_dir=workdir, mem_limit=limits.memory_bytes, memswap_limit=limits.memory_bytes,
            nano_cpus=int(limits.cpus * 1e9), pids_limit=limits.pids, security_opt=["no-new-privileges"],
            cap_drop=["ALL"], labels={LABEL: role}, init=True, detach=True,
        )
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
        output = container.logs(stdout=True, stderr=True).decode(errors="replace")
        files: dict[str, bytes] = {}
        if collect:
            try:
                stream, _ = container.get_archive(collect)
                files = untar_files(b"".join(stream))
            except NotFound:
                files = {}
        return RunResult(code, output[-20000:], timed_out, time.monotonic() - started, files)
    except (APIError, DockerException) as e:
        raise InfraError(f"running a container from {image}: {e}") from e
    finally:
        with contextlib.suppress(APIError, DockerException):
            container.remove(force=True)
