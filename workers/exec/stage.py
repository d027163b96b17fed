"""``exec``: ``exec.requests`` -> results. Isolated sessions on built images: files, commands, tests with unified
coverage, linters, snapshots and forks.

Requests are keyed by session (ordered per session, sessions concurrent) and sent to the partition the session
lives on; ``open`` is keyed by repository. Every limit a request asks for is checked against this deployment's caps
(``KILN_EXEC_MAX_*``). Configuration: ``KILN_EXEC_*`` (see ``ExecSettings``).

This module is the handler and its wiring; the parts live beside it: sessions (``sessions``), the reaper and the
liveness lock (``reaper``), the warm pool (``warm``), the runners (``runners``) and their wire protocol
(``protocol``), the operations by op name (``ops``), the metrics (``metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.exec import ExecRequest, ExecResult, SessionLimits
from kiln.streams.blobstore import open_blob_store
from kiln.streams.settings import get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.common.containers import docker_client
from kiln.workers.common.image_cache import ImageCache
from kiln.workers.common.liveness import LivenessLock, namespace
from kiln.workers.common.registry import Registry
from kiln.workers.exec import spec
from kiln.workers.exec.errors import LimitExceeded
from kiln.workers.exec.metrics import HANDOVERS, LATENCY, OPENED, SESSIONS, registry
from kiln.workers.exec.ops import SessionOps, checked_report, ensure_image, run_once
from kiln.workers.exec.reaper import Reaper
from kiln.workers.exec.runners import RunnerPool, supervisor_binary
from kiln.workers.exec.sessions import REPLAY_BYTES, LabelSeal, SessionManager
from kiln.workers.exec.warm import WarmPool

__all__ = ["ExecService", "ExecSettings", "checked_report", "service", "stage"]


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


class ExecService:
    def __init__(self) -> None:
        self.settings = ExecSettings()
        self.manager: SessionManager | None = None
        self.images: ImageCache | None = None
        self.warm: WarmPool | None = None
        self.reaper: Reaper | None = None
        self.ops: SessionOps | None = None
        self.lock: LivenessLock | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.worker_id = ""
        self.runners: RunnerPool | None = None
        self._sessionless: dict[str, Callable[[ExecRequest, JobContext], Awaitable[ExecResult]]] = {
            "run_once": self._run_once, "open": self._open_request}

    async def setup(self, slots: int) -> None:
        client = await asyncio.to_thread(docker_client)
        # One id per process: the lock file proves this process is alive to the reapers of other workers.
        self.worker_id = f"exec-{int(time.time() * 1000):x}-{id(self) & 0xFFFF:x}"
        self.lock = LivenessLock(self.settings.lock_dir, self.worker_id)
        await asyncio.to_thread(self.lock.hold)
        labels = {"kiln.lock": str(self.lock.path), "kiln.lockns": namespace()}
        seal = await asyncio.to_thread(LabelSeal.load, self.settings.seal_dir)
        self.manager = SessionManager(client, self.worker_id, open_blob_store(get_settings()),
                                      self.settings.image_prefixes, labels, seal=seal,
                                      replay_bytes=self.settings.replay_cache_bytes,
                                      replay_total_bytes=self.settings.replay_cache_total_bytes)
        registry_ = (Registry(self.settings.registry, self.settings.registry_user, self.settings.registry_password)
                     if self.settings.registry else None)
        self.images = ImageCache(client, registry_, self.settings.pulled_images_max)
        self.warm = WarmPool(self.manager, self.settings.warm, self.settings.warm_images)
        self.ops = SessionOps(self.manager, self.open_session)
        cache, prebuilt = self.settings.supervisor_cache, self.settings.supervisor
        # As many idle runners per image as calls can run at once here: a batch finds them warm.
        self.runners = RunnerPool(client, self.manager.sealed_labels, lambda: supervisor_binary(cache, prebuilt),
                                  self.manager.image_work, per_key=max(1, slots),
                                  keys=max(1, self.settings.warm_images))
        self.reaper = Reaper(self.manager, self.worker_id, self.settings.max_session_age_s, self._held)
        await asyncio.to_thread(self.runners.ready)
        await asyncio.to_thread(self.reaper.reap)
        self._tasks = [asyncio.create_task(self._housekeeping())]

    def _held(self) -> set[str]:
        """Containers this worker holds besides its sessions: warm ones, ones being opened, runners."""
        warm = self.warm.container_ids() if self.warm is not None else set()
        return warm | (self.runners.container_ids() if self.runners is not None else set())

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
        if self.warm is not None:
            await asyncio.to_thread(self.warm.close)
        if self.runners is not None:
            await asyncio.to_thread(self.runners.close)
        if self.lock is not None:
            await asyncio.to_thread(self.lock.release)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                assert self.reaper is not None
                await asyncio.to_thread(self.reaper.reap)
            except Exception:  # the next round tries again; housekeeping must never die
                log.exception("exec housekeeping failed; retrying next round")

    async def prewarm(self, image: str) -> None:
        assert self.warm is not None
        await asyncio.to_thread(self.warm.refill, image)

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

    async def _dispatch(self, request: ExecRequest, ctx: JobContext) -> ExecResult:
        assert self.manager is not None and self.ops is not None
        manager = self.manager
        self.settings.check(request)
        sessionless = self._sessionless.get(request.op)
        if sessionless is not None:
            return await sessionless(request, ctx)
        request_id = ctx.envelope.request_id
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
        result = await self.ops.execute(request, ctx, session)
        with session.lock:
            session.remember(request_id, result)
        return result

    async def _run_once(self, request: ExecRequest, ctx: JobContext) -> ExecResult:
        assert self.manager is not None and self.images is not None and self.runners is not None
        return await run_once(self.manager, self.images, self.runners, request, ctx)

    async def _open_request(self, request: ExecRequest, ctx: JobContext) -> ExecResult:
        assert self.manager is not None
        if request.snapshot is not None:
            await ctx.cancel.run(self.manager.check_snapshot, ctx.envelope.request_id, request)
        return await self.open_session(request, ctx, request.image or "")

    async def open_session(self, request: ExecRequest, ctx: JobContext, image: str) -> ExecResult:
        """A new session for ``request`` (open, or fork: then ``request.snapshot`` is the parent's state)."""
        assert self.manager is not None and request.client_key is not None
        manager = self.manager
        manager.check_image(image)
        assert self.images is not None and self.warm is not None
        warm_pool = self.warm
        await ensure_image(self.images, image, ctx)
        entry = warm_pool.take(image) if request.limits == SessionLimits() and request.snapshot is None else None
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
            warm_pool.adopted(entry[0].id)
        session.partition = ctx.partition
        OPENED.labels(str(warm).lower()).inc()
        refill = asyncio.create_task(asyncio.to_thread(warm_pool.refill, image))
        refill.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        return ExecResult(op=request.op, session_id=session.id, sealed_key=sealed, partition=ctx.partition,
                          image=image, warm=warm)


service = ExecService()
# A call's CPU is its sandbox's, not the worker's: the worker mostly waits (the broker, the runner's stream), so it
# keeps many per CPU in flight. Measured with bench/reward_throughput.py on 2 CPUs: 8 slots gave 0.52-0.89 of bare
# subprocesses, 24 gave 0.72-0.96 (README, Benchmarks).
stage = Stage(spec.exec_, service.handle, max_attempts=1, registry=registry, setup=service.setup, slots_per_cpu=12,
              teardown=service.teardown, on_revoke=service.on_revoke,
              gauges=lambda: {"sessions_open": float(len(service.manager.sessions) if service.manager else 0)})
