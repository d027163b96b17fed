"""``exec``: ``exec.requests`` -> results. Isolated sessions on built images: files, commands, tests with unified
coverage, linters, snapshots and forks.

Requests are keyed by session (ordered per session, sessions concurrent) and sent to the partition the session
lives on; ``open`` is keyed by repository. A warm pool keeps ready containers for recently opened images. Every
limit a request asks for is checked against this deployment's caps (``KILN_EXEC_MAX_*``). Every worker holds a
lock file while alive and labels its containers with that file's path and its mount namespace, sealed
(``sessions.LabelSeal``: an image's own labels prove nothing); a reaper judges only sealed containers whose lock it
can see (same namespace) and never creates the lock it checks; containers of workers it cannot see are removed
only past the longest a session may live. Configuration: ``KILN_EXEC_*``
(see ``ExecSettings``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import logging
import os
import shlex
import time
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from docker.errors import APIError, DockerException
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.exec import (
    CommandOutput,
    ExecRequest,
    ExecResult,
    FileContent,
    RunStep,
    SessionLimits,
    StepOutput,
    file_content,
)
from kiln.schemas.images import ImageContract
from kiln.schemas.reports import TestReport
from kiln.streams.blobstore import open_blob_store
from kiln.streams.settings import get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.common import reports
from kiln.workers.common.containers import docker_client
from kiln.workers.common.image_cache import ImageCache
from kiln.workers.common.registry import Registry
from kiln.workers.exec import spec
from kiln.workers.exec.errors import LimitExceeded, SessionError
from kiln.workers.exec.metrics import (
    HANDOVERS,
    LATENCY,
    OPENED,
    REAPED,
    RUNNERS_DISCARDED,
    SESSIONS,
    TIMEOUTS,
    registry,
)
from kiln.workers.exec.runners import RunnerPool, supervisor_binary
from kiln.workers.exec.sessions import REPLAY_BYTES, ROLE, LabelSeal, Session, SessionManager, safe_path


class ExecSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_EXEC_")

    image_prefixes: list[str] = Field(default_factory=lambda: ["kiln/"], description="Images sessions may use.")
    warm: int = Field(2, ge=0, le=64, description="Ready containers kept per hot image.")
    warm_images: int = Field(4, ge=0, description="How many recently opened images get a warm pool.")
    reap_interval_s: float = Field(30.0, gt=0)
    lock_dir: Path = Field(Path("/run/kiln/exec"), description="Liveness lock files of the exec workers of a host.")
    seal_dir: Path = Field(Path("/run/kiln"), description="Where the host's label-seal secret (.kiln-seal-key) lives: "
                                                          "one for every exec worker of the host, so any of them "
                                                          "may reap a dead one's containers.")
    max_memory_mb: int = Field(4096, ge=32, description="Cap on a session's memory.")
    max_cpus: float = Field(2.0, gt=0, description="Cap on a session's CPUs.")
    max_pids: int = Field(1024, ge=16, description="Cap on a session's processes.")
    max_disk_mb: int = Field(2048, ge=8, description="Cap on a session's work area (/work + /tmp).")
    max_idle_timeout_s: float = Field(3600.0, gt=0, description="Cap on how long a session may sit idle.")
    max_timeout_s: float = Field(3600.0, gt=0, description="Cap on one command's time limit.")
    max_output_bytes: int = Field(4 << 20, ge=0, description="Cap on the output kept per stream of a command.")
    registry: str = Field("", description="Registry (host:port) sessions may pull images from by reference, e.g. "
                                          "a built revision's registry/name@sha256:...; its prefix must also be in "
                                          "image_prefixes. Empty: local images only.")
    registry_user: str = ""
    registry_password: str = Field("", repr=False)
    pulled_images_max: int = Field(8, ge=1, description="Images pulled by this worker kept on its engine (LRU).")
    max_session_age_s: float = Field(24 * 3600.0, gt=0, description="Containers of workers this one cannot see "
                                                                    "are reaped past this age.")
    replay_cache_bytes: int = Field(REPLAY_BYTES, ge=0, description="Results kept per session to answer replayed "
                                                                    "request ids (bytes; beyond, the oldest are "
                                                                    "forgotten and their replays refused).")
    replay_cache_total_bytes: int = Field(16 * REPLAY_BYTES, ge=0, description="The same, for all sessions of "
                                                                               "the worker together.")
    supervisor: Path | None = Field(None, description="The runner supervisor's built binary (an image that ships "
                                                      "it); unset: built with Go from the source once per version.")
    supervisor_cache: Path = Field(Path.home() / ".cache" / "kiln", description="Where the built supervisor is kept.")

    def check(self, request: ExecRequest) -> None:
        """Refuse (visibly) a request asking for more than this deployment allows."""
        asked = [("memory_mb", request.limits.memory_mb, self.max_memory_mb),
                 ("cpus", request.limits.cpus, self.max_cpus), ("pids", request.limits.pids, self.max_pids),
                 ("disk_mb", request.limits.disk_mb, self.max_disk_mb),
                 ("idle_timeout_s", request.limits.idle_timeout_s, self.max_idle_timeout_s),
                 ("timeout_s", request.timeout_s, self.max_timeout_s),
                 ("max_output_bytes", request.max_output_bytes, self.max_output_bytes),
                 *((f"steps[{s.name}].timeout_s", s.timeout_s, self.max_timeout_s) for s in request.steps)]
        over = [f"{name}={value:g} (cap {cap:g})" for name, value, cap in asked if value > cap]
        if over:
            raise LimitExceeded(f"limits above this deployment's caps: {', '.join(over)}")


log = logging.getLogger(__name__)
WarmEntry = tuple[Any, list[str], int, int]
MAX_FETCH_BYTES = 16 << 20  # files a run_once call fetches back, in all


class ExecService:
    def __init__(self) -> None:
        self.settings = ExecSettings()
        self.manager: SessionManager | None = None
        self.images: ImageCache | None = None
        self.warm: OrderedDict[str, list[WarmEntry]] = OrderedDict()
        self._lock_file: Any = None
        self._opening: set[str] = set()  # containers taken from the warm pool, not yet adopted
        self._tasks: list[asyncio.Task[None]] = []
        self.worker_id = ""
        self.runners: RunnerPool | None = None

    async def setup(self, slots: int) -> None:
        client = await asyncio.to_thread(docker_client)
        # One id per process: the lock file proves this process is alive to the reapers of other workers.
        self.worker_id = f"exec-{int(time.time() * 1000):x}-{id(self) & 0xFFFF:x}"
        await asyncio.to_thread(self._hold_liveness_lock)
        labels = {"kiln.lock": str(self._lock_path()), "kiln.lockns": _namespace()}
        seal = await asyncio.to_thread(LabelSeal.load, self.settings.seal_dir)
        self.manager = SessionManager(client, self.worker_id, open_blob_store(get_settings()),
                                      self.settings.image_prefixes, labels, seal=seal,
                                      replay_bytes=self.settings.replay_cache_bytes,
                                      replay_total_bytes=self.settings.replay_cache_total_bytes)
        registry_ = (Registry(self.settings.registry, self.settings.registry_user, self.settings.registry_password)
                     if self.settings.registry else None)
        self.images = ImageCache(client, registry_, self.settings.pulled_images_max)
        cache, prebuilt = self.settings.supervisor_cache, self.settings.supervisor
        # As many idle runners per image as calls can run at once here: a batch finds them warm.
        self.runners = RunnerPool(client, self.manager.sealed_labels, lambda: supervisor_binary(cache, prebuilt),
                                  self.manager.image_work, per_key=max(1, slots),
                                  keys=max(1, self.settings.warm_images))
        await asyncio.to_thread(self.runners.ready)
        await asyncio.to_thread(self.reap)
        self._tasks = [asyncio.create_task(self._housekeeping())]

    def _lock_path(self) -> Path:
        return (self.settings.lock_dir / f"{self.worker_id}.lock").resolve()

    def _hold_liveness_lock(self) -> None:
        self.settings.lock_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._lock_path().open("w")
        fcntl.flock(self._lock_file, fcntl.LOCK_EX)

    async def on_revoke(self, partitions: list[int]) -> None:
        """The partitions leave this worker (their commands have finished): hand their sessions over, so a
        rebalance (a scale-out, a rolling restart) does not kill them; the next owner restores each lazily."""
        if self.manager is None:
            return
        manager = self.manager
        for session in [s for s in manager.sessions.values() if s.partition in partitions]:
            try:
                await asyncio.to_thread(manager.hand_over, session)
                HANDOVERS.labels("handed_over").inc()
            except Exception:  # one session's failure loses that session only
                log.exception("handing over session %s failed", session.id)
                await asyncio.to_thread(manager.close, session)

    async def teardown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.manager is not None:
            for session in list(self.manager.sessions.values()):
                await asyncio.to_thread(self.manager.close, session)
            for entries in self.warm.values():
                for container, volumes, _, _ in entries:
                    await asyncio.to_thread(self.manager.remove, container, volumes)
        if self.runners is not None:
            await asyncio.to_thread(self.runners.close)
        if self._lock_file is not None:
            path = Path(self._lock_file.name)
            self._lock_file.close()
            await asyncio.to_thread(path.unlink, True)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await asyncio.to_thread(self.reap)
            except Exception:  # the next round tries again; housekeeping must never die
                log.exception("exec housekeeping failed; retrying next round")

    def reap(self) -> None:
        """Remove session containers of dead workers, our own strays, and idle sessions. Only labels a seal of this
        host covers are read: an image's own labels imitating kiln's (Docker merges them into its containers')
        make a container the reaper never touches."""
        assert self.manager is not None
        manager = self.manager
        idle = manager.expire_idle()
        if idle:
            REAPED.labels("idle").inc(idle)
        ours = {s.container.id for s in manager.sessions.values()} | self._opening | {
            e[0].id for entries in self.warm.values() for e in entries} | (
            self.runners.container_ids() if self.runners is not None else set())
        try:
            containers = manager.client.containers.list(all=True, filters={"label": f"kiln.role={ROLE}"})
        except (APIError, DockerException):
            return
        namespace = _namespace()
        for container in containers:
            labels = manager.seal.recorded(container.name, container.labels)
            if labels is None:  # not created by kiln on this host (or by one before seals): not ours to judge
                continue
            age = time.time() - _created(container)
            if labels.get("kiln.worker", "") == self.worker_id:
                if container.id not in ours and age > 60:
                    self._reap(container, "stray")
            elif labels.get("kiln.lockns") == namespace and labels.get("kiln.lock"):
                if not _owner_alive(Path(labels["kiln.lock"])):
                    self._reap(container, "worker_gone")
            elif age > self.settings.max_session_age_s:  # a worker this one cannot see: only the age tells
                self._reap(container, "expired")
        SESSIONS.set(len(manager.sessions))

    def _reap(self, container: Any, reason: str) -> None:
        assert self.manager is not None
        name = container.name
        mounted = [str(m.get("Name", "")) for m in container.attrs.get("Mounts") or [] if m.get("Type") == "volume"]
        # The session's own volumes (work, tmp, those on paths its image declares): named after it, kiln-made.
        volumes = {f"{name}-work", f"{name}-tmp", *(v for v in mounted if v.startswith(f"{name}-"))}
        self.manager.remove(container, sorted(volumes))
        REAPED.labels(reason).inc()

    # --- warm pool -------------------------------------------------------------------------------------------

    def _take_warm(self, image: str) -> WarmEntry | None:
        entries = self.warm.get(image)
        if entries:
            self.warm.move_to_end(image)
            entry = entries.pop()
            self._opening.add(entry[0].id)  # neither warm nor a session yet: the reaper must not take it
            return entry
        return None

    def _refill(self, image: str) -> None:
        assert self.manager is not None
        if self.settings.warm == 0 or self.settings.warm_images == 0:
            return
        self.warm.setdefault(image, [])
        self.warm.move_to_end(image)
        while len(self.warm) > self.settings.warm_images:
            _, dropped = self.warm.popitem(last=False)
            for container, volumes, _, _ in dropped:
                self.manager.remove(container, volumes)
        while image in self.warm and len(self.warm[image]) < self.settings.warm:
            container, volumes, keeper, init_pid = self.manager.create_container(image, SessionLimits())
            self.manager.populate(container, image, None, SessionLimits())
            self.warm[image].append((container, volumes, keeper, init_pid))

    async def prewarm(self, image: str) -> None:
        await asyncio.to_thread(self._refill, image)

    # --- requests --------------------------------------------------------------------------------------------

    async def handle(self, request: ExecRequest, ctx: JobContext) -> ExecResult:
        if self.manager is None:
            await self.setup(1)
        assert self.manager is not None
        started = time.monotonic()
        try:
            return await self._dispatch(request, ctx)
        finally:
            LATENCY.labels(request.op).observe(time.monotonic() - started)
            SESSIONS.set(len(self.manager.sessions))

    async def _open(self, request: ExecRequest, ctx: JobContext, image: str) -> ExecResult:
        """A new session for ``request`` (open, or fork: then ``request.snapshot`` is the parent's state)."""
        assert self.manager is not None and request.client_key is not None
        manager = self.manager
        manager.check_image(image)
        assert self.images is not None
        await ctx.cancel.run(self.images.ensure, image)
        entry = self._take_warm(image) if request.limits == SessionLimits() and request.snapshot is None else None
        warm = entry is not None
        if entry is None:
            entry = await ctx.cancel.run(manager.create_container, image, request.limits)
            try:
                await ctx.cancel.run(manager.populate, entry[0], image, request.snapshot, request.limits)
            except BaseException:
                await ctx.cancel.run(manager.remove, entry[0], entry[1])
                raise
        try:
            session, sealed = await ctx.cancel.run(manager.adopt, *entry, image=image, limits=request.limits,
                                                      client_id=ctx.envelope.client_id, client_key=request.client_key)
        except BaseException:
            await ctx.cancel.run(manager.remove, entry[0], entry[1])
            raise
        finally:
            self._opening.discard(entry[0].id)
        session.partition = ctx.partition
        OPENED.labels(str(warm).lower()).inc()
        refill = asyncio.create_task(asyncio.to_thread(self._refill, image))
        refill.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        return ExecResult(op=request.op, session_id=session.id, sealed_key=sealed, partition=ctx.partition,
                          image=image, warm=warm)

    async def _dispatch(self, request: ExecRequest, ctx: JobContext) -> ExecResult:
        assert self.manager is not None
        manager = self.manager
        self.settings.check(request)
        request_id = ctx.envelope.request_id
        if request.op == "run_once":
            return await self._run_once(request, ctx)
        if request.op == "open":
            if request.snapshot is not None:
                await ctx.cancel.run(manager.check_snapshot, request_id, request)
            return await self._open(request, ctx, request.image or "")
        if request.session_id not in manager.sessions:  # perhaps handed over by the partition's former owner
            restored = await ctx.cancel.run(manager.take_over, request.session_id or "", request_id, request,
                                            ctx.partition)
            if restored is not None:
                HANDOVERS.labels("taken_over").inc()
        session = await ctx.cancel.run(manager.get, request.session_id, request_id, request)
        with session.lock:
            first = session.answered(request_id)
        if first is not None:  # a replay (or a redelivery): the first result again, never a second execution
            return first
        result = await self._execute(request, ctx, session)
        with session.lock:
            session.remember(request_id, result)
        return result

    async def _run_once(self, request: ExecRequest, ctx: JobContext) -> ExecResult:
        """A stateless call on a warm runner: nothing of it outlives it, so a replay just runs it again."""
        assert self.manager is not None and self.images is not None and self.runners is not None
        image, runners = request.image or "", self.runners
        self.manager.check_image(image)
        if not runners.serves(image):  # a Docker API round trip only for an image no runner has yet
            await ctx.cancel.run(self.images.ensure, image)
        steps = request.steps or ([RunStep(name="run", command=request.command, timeout_s=request.timeout_s)]
                                  if request.command else [])
        contract, env, fetch = ImageContract(), dict(request.env), list(request.paths)
        if request.tests:
            contract = await ctx.cancel.run(_image_contract, self.manager, image)
            if not contract.test:
                raise SessionError(f"image {image} records no test command")
            steps = [*steps, RunStep(name="tests", command=f"rm -rf {contract.reports_dir}; {contract.test}",
                                     timeout_s=request.timeout_s)]
            env = {**contract.env, **env}
            fetch.append(f"{contract.reports_dir}/")
        call = {"files": [{"path": safe_path(f.path), "mode": f.mode,
                           "data": f.content_b64 if f.text is None else base64.b64encode(f.text.encode()).decode()}
                          for f in request.files],
                "steps": [{"name": s.name, "command": s.command, "timeout_ms": int(s.timeout_s * 1000),
                           "always": s.always,
                           "stdin": None if s.stdin is None else base64.b64encode(s.stdin.encode()).decode()}
                          for s in steps],
                "env": env, "cwd": safe_path(request.cwd) if request.cwd else "",
                "cap": request.max_output_bytes, "fetch": fetch, "fetch_cap": MAX_FETCH_BYTES}
        runner = await ctx.cancel.run(runners.take, image, request.limits)
        ctx.cancel.on_cancel(lambda: runners.discard(runner))
        try:
            answer = await ctx.cancel.run(runner.call, call, sum(s.timeout_s for s in steps) + 60.0)
        except BaseException:
            await asyncio.to_thread(runners.give, runner, False)
            raise
        clean = bool(answer.get("clean"))
        if not clean:
            RUNNERS_DISCARDED.inc()
            log.warning("runner %s discarded: %s", runner.container.name, answer.get("residue") or answer.get("error"))
        await asyncio.to_thread(runners.give, runner, clean)
        if answer.get("error"):
            raise SessionError(f"run_once: {answer['error']}")
        outputs = [_step_output(s) for s in answer.get("steps", [])]
        if any(o.timed_out for o in outputs):
            TIMEOUTS.inc()
        fetched = {path: base64.b64decode(data) for path, data in (answer.get("files") or {}).items()}
        tests = None
        if request.tests:
            found = {p.removeprefix(f"{contract.reports_dir}/"): fetched.pop(p) for p in list(fetched)
                     if p.startswith(f"{contract.reports_dir}/")}
            # A runner that writes reports but left none did not finish its suite (or was ended from inside).
            if outputs and outputs[-1].name == "tests" and (found or contract.reports_dir not in contract.test):
                tests = checked_report(reports.parse_results(contract.system or "custom", outputs[-1].exit_code,
                                                             found, contract.module), outputs[-1])
        files = [_file(p, d) for p, d in fetched.items()]
        return ExecResult(op="run_once", session_id="", partition=ctx.partition, image=image, steps=outputs,
                          output=outputs[-1] if outputs else None, files=files, tests=tests)

    async def _execute(self, request: ExecRequest, ctx: JobContext, session: Session) -> ExecResult:
        assert self.manager is not None
        manager = self.manager
        result = ExecResult(op=request.op, session_id=session.id, partition=ctx.partition, image=session.image)
        if request.op == "close":
            await ctx.cancel.run(manager.close, session)
            return result
        if request.op == "fork":
            digest, size = await ctx.cancel.run(manager.snapshot, session)
            fork = request.model_copy(update={"snapshot": digest, "limits": session.limits})
            forked = await self._open(fork, ctx, session.image)
            return forked.model_copy(update={"op": "fork", "snapshot": digest, "snapshot_bytes": size})
        if request.op == "snapshot":
            digest, size = await ctx.cancel.run(manager.snapshot, session)
            return result.model_copy(update={"snapshot": digest, "snapshot_bytes": size})
        if request.op == "write_files":
            await ctx.cancel.run(manager.write_files, session, request.files)
            return result
        if request.op == "read_files":
            return result.model_copy(update={"files": await ctx.cancel.run(manager.read_files, session,
                                                                               request.paths)})
        if request.op == "delete_files":
            paths = " ".join(_quote(p) for p in request.paths)
            output = await self._run(session, f"rm -rf -- {paths}", request, ctx)
            return result.model_copy(update={"output": output})
        if request.op == "apply_patch":
            patch = (request.patch or "").encode()
            where = await ctx.cancel.run(manager.put_tmp, session, ".kiln-patch.diff", patch)
            output = await self._run(session, f"git apply --whitespace=nowarn {where}", request, ctx)
            return result.model_copy(update={"output": output})
        if request.op == "run":
            output = await self._run(session, request.command or "", request, ctx)
            return result.model_copy(update={"output": output})
        contract = await ctx.cancel.run(_session_contract, session)
        if request.op == "run_tests":
            command = request.command or contract.test
            if not command:
                raise SessionError(f"image {session.image} records no test command: pass one")
            # The run ends with every session process gone (swept from outside), so the reports read below were
            # written by this run and nothing can rewrite them.
            output = await self._run(session, f"rm -rf {contract.reports_dir}; {command}", request, ctx,
                                     env=contract.env)
            files = await ctx.cancel.run(manager.collect, session, contract.reports_dir)
            tests = checked_report(reports.parse_results(contract.system or "custom", output.exit_code, files,
                                                         contract.module), output)
            return result.model_copy(update={"output": output, "tests": tests})
        command = request.command or contract.lint
        if not command:
            raise SessionError(f"image {session.image} records no lint command: pass one")
        output = await self._run(session, command, request, ctx, env=contract.env)
        findings = reports.lint_findings(output.stdout)
        return result.model_copy(update={"output": output, "findings": findings})

    async def _run(self, session: Session, command: str, request: ExecRequest, ctx: JobContext,
                   env: dict[str, str] | None = None) -> Any:
        assert self.manager is not None
        manager = self.manager
        # Given up (timeout, revoke): the session's processes are killed, so the command's thread returns.
        ctx.cancel.on_cancel(lambda: manager.sweep(session))
        output = await ctx.cancel.run(manager.run, session, command, request.timeout_s, request.max_output_bytes,
                                      env)
        if output.timed_out:
            TIMEOUTS.inc()
        return output


def checked_report(report: TestReport | None, output: CommandOutput) -> TestReport | None:
    """A report is the runner's word; the exit status is measured outside the sandbox. A report that shows no
    failure from a run that failed (or timed out) gains an error, so it can never score as a clean pass."""
    if report is None or (output.exit_code == 0 and not output.timed_out) or report.failed + report.errors:
        return report
    return report.model_copy(update={"errors": 1})


def _file(path: str, data: bytes) -> FileContent:
    """Text when it decodes, else base64 (as ``read_files`` answers)."""
    try:
        return FileContent(path=path, text=data.decode())
    except UnicodeDecodeError:
        return file_content(path, data)


def _contract(labels: Mapping[str, str] | None, image: str) -> ImageContract:
    """What the image declares (its labels, written by the build stage); a contract this worker cannot read is the
    request's error, answered, never a retry."""
    try:
        return ImageContract.from_labels(labels)
    except ValidationError as e:
        raise SessionError(f"image {image}: its image contract is unreadable here: {e}") from e


def _image_contract(manager: SessionManager, image: str) -> ImageContract:
    try:
        labels = manager.client.images.get(image).labels
    except (APIError, DockerException):
        labels = None
    return _contract(labels, image)


def _step_output(step: dict[str, Any]) -> StepOutput:
    """The supervisor's measure of a step: a step ended by a signal exits 128 + signal, as a shell reports it."""
    signal_ = int(step.get("signal") or 0) or None
    code = step.get("exit_code")
    if code is None and signal_ is not None:
        code = 128 + signal_
    return StepOutput(name=str(step["name"]), exit_code=code, signal=signal_, timed_out=bool(step.get("timed_out")),
                      stdout=base64.b64decode(step.get("stdout") or "").decode(errors="replace"),
                      stderr=base64.b64decode(step.get("stderr") or "").decode(errors="replace"),
                      stdout_truncated=bool(step.get("stdout_truncated")),
                      stderr_truncated=bool(step.get("stderr_truncated")),
                      duration_s=round(int(step.get("wall_us") or 0) / 1e6, 4),
                      cpu_s=round(int(step.get("cpu_us") or 0) / 1e6, 4))


def _quote(path: str) -> str:
    return shlex.quote(safe_path(path))


def _session_contract(session: Session) -> ImageContract:
    try:
        labels = session.container.image.labels
    except (APIError, DockerException):
        labels = None
    return _contract(labels, session.image)


def _created(container: Any) -> float:
    raw = str(container.attrs.get("Created", ""))[:19]
    try:
        return datetime.strptime(raw, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0


def _namespace() -> str:
    """Where lock paths mean the same file: this boot's id and this process's mount namespace."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.readlink('/proc/self/ns/mnt')}"


def _owner_alive(lock_path: Path) -> bool:
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


service = ExecService()
# A call's CPU is its sandbox's, not the worker's: the worker mostly waits (the broker, the runner's stream), so it
# keeps many per CPU in flight. Measured with bench/reward_throughput.py on 2 CPUs: 8 slots gave 0.52-0.89 of bare
# subprocesses, 24 gave 0.72-0.96 (README, Benchmarks).
stage = Stage(spec.exec_, service.handle, max_attempts=1, registry=registry, setup=service.setup, slots_per_cpu=12,
              teardown=service.teardown, on_revoke=service.on_revoke,
              gauges=lambda: {"sessions_open": float(len(service.manager.sessions) if service.manager else 0)})
