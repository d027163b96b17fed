"""``build``: ``image.build`` -> ``image.events``. Repository revision (read through Saucer) -> image, tests,
unified coverage, and a failure class when it does not work out.

Configuration (``KILN_BUILD_*``, the build stage's one prefix; ``KILN_BUILDER_*``, the old names, are read until
the next release): ``BASE_IMAGE``/``TOOLCHAIN_IMAGE`` (the local images hub images map to, built by ``kiln setup
docker``), ``TEST_MEMORY_MB``, ``TEST_CPUS``, ``TEST_PIDS``, ``TEST_TIMEOUT_S``, ``TEST_OUTPUT_BYTES`` (64 KiB of a
test run's output kept), ``TEST_REPORTS_BYTES`` (256 MiB), and the fallback agent: ``AGENT`` (on),
``AGENT_BUDGET``, ``AGENT_URL``/``AGENT_MODEL``/``AGENT_API_KEY`` (an OpenAI-compatible endpoint; without one the
agent reads README and CI commands deterministically), ``LOCK_DIR`` and ``REAP_INTERVAL_S`` (the worker's liveness
lock, and how often it removes what dead builders of its host left: ``leftovers.py``). The build steps' sandbox
reads the same prefix (``BuildSandbox``, ``workers/builder/sandbox.py``). ``BASE_IMAGE``/``TOOLCHAIN_IMAGE`` may be
references in ``REGISTRY`` (``registry/name@sha256:...``): a worker node holding no local images pulls them on
first use."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.streams.settings import RenamedPrefix, get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.builder import leftovers, spec
from kiln.workers.builder.agent import AgentConfig, ModelClient
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.revisions import build_layered
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits, docker_client
from kiln.workers.common.image_cache import ImageCache
from kiln.workers.common.registry import Registry


class BuilderSettings(RenamedPrefix):
    """The build stage's settings (``KILN_BUILD_`` + field name, as ``BuildSandbox``'s: one prefix per stage;
    ``KILN_BUILDER_`` + field name is the old name, read until the next release with a warning)."""

    model_config = SettingsConfigDict(env_prefix="KILN_BUILD_")
    renamed_from: ClassVar[str] = "KILN_BUILDER_"

    base_image: str = "kiln/base:latest"
    toolchain_image: str = "kiln/toolchain:latest"
    test_memory_mb: int = Field(2048, ge=64)
    test_cpus: float = Field(2.0, gt=0)
    test_pids: int = Field(1024, ge=16)
    test_timeout_s: float = Field(900.0, gt=0)
    test_output_bytes: int = Field(64 << 10, ge=1024, description="The tail of a test run's output kept in memory.")
    test_reports_bytes: int = Field(256 << 20, ge=1 << 20, description="The most of a test run's reports directory "
                                    "read back; a larger one is not read (the run counts as having no results).")
    registry: str = Field("127.0.0.1:5000", description="Registry (host:port, plain HTTP) layered builds push to.")
    registry_user: str = Field("", description="Registry user (infra/registry/registry.sh env).")
    registry_password: str = Field("", repr=False, description="Registry password.")
    agent: bool = Field(True, description="Fall back to the README/CI agent when the rules fail.")
    agent_budget: int = Field(16, ge=1, le=100, description="Commands the agent may run per build.")
    agent_url: str | None = Field(None, description="OpenAI-compatible endpoint (…/v1/chat/completions) for the agent.")
    agent_model: str = "gpt-4o-mini"
    agent_api_key: str = ""
    lock_dir: Path = Field(Path("/run/kiln/build"), description="Liveness lock files of the builder workers of a host.")
    reap_interval_s: float = Field(60.0, gt=0, description="How often a builder removes the containers of dead "
                                                           "builders' builds (and once at its start).")


registry = CollectorRegistry()
BUILDS = Counter("kiln_build_total", "Builds finished, by build system and status.", ["system", "status"],
                 registry=registry)
FAILURES = Counter("kiln_build_failures_total", "Failed builds, by build system and failure class.",
                   ["system", "reason"], registry=registry)
SECONDS = Histogram("kiln_build_seconds", "Build duration (dependencies, build, tests).", ["system"],
                    registry=registry, buckets=(1, 5, 15, 60, 180, 600, 1800))
CACHED = Counter("kiln_build_cache_total", "Requests answered from the build cache.", registry=registry)
LEFTOVERS = Counter("kiln_build_leftovers_reaped_total", "Containers of dead builders' builds removed.",
                    registry=registry)
# Base images pulled from the registry kept on the engine beyond those in use (older base and toolchain digests).
BASES_KEPT = 4

log = logging.getLogger(__name__)


class _Builder:
    def __init__(self) -> None:
        self.client: Any = None
        self.store: SaucerStore | None = None
        self.bases: ImageCache | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def setup(self, slots: int) -> None:
        """Hold this worker's liveness lock, remove what dead builders of the host left, and keep doing so."""
        cfg = BuilderSettings()
        await asyncio.to_thread(leftovers.WORKER.hold, cfg.lock_dir)
        await self._reap()
        self._tasks = [asyncio.create_task(self._housekeeping(cfg.reap_interval_s))]

    async def teardown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.to_thread(leftovers.WORKER.release, BuildSandbox().cgroup)

    async def _reap(self) -> None:
        if self.client is None:
            self.client = await asyncio.to_thread(docker_client)
        removed = await asyncio.to_thread(leftovers.reap, self.client, BuildSandbox().cgroup,
                                          BuilderSettings().lock_dir)
        if removed:
            LEFTOVERS.inc(removed)
            log.info("removed %d containers left by dead builders", removed)

    async def _housekeeping(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._reap()
            except Exception:  # the next round tries again; housekeeping must never die
                log.exception("build housekeeping failed; retrying next round")

    async def _ensure_bases(self, cfg: BuilderSettings, bases: BaseImages, ctx: JobContext) -> None:
        """Base images given as registry references pulled (by digest) when this engine lacks them."""
        if self.bases is None:
            registry_ = Registry(cfg.registry, cfg.registry_user, cfg.registry_password)
            self.bases = ImageCache(self.client, registry_, BASES_KEPT)
        for image in (bases.base, bases.toolchain):
            if self.bases.from_registry(image):
                await ctx.cancel.run(self.bases.ensure, image)

    async def handle(self, request: BuildRequest, ctx: JobContext) -> BuildEvent:
        settings, cfg = get_settings(), BuilderSettings()
        if self.client is None:
            self.client = await asyncio.to_thread(docker_client)
        if self.store is None:
            self.store = SaucerStore.from_settings(settings)
        limits = Limits(memory_bytes=cfg.test_memory_mb << 20, cpus=cfg.test_cpus, pids=cfg.test_pids,
                        timeout_s=cfg.test_timeout_s, output_bytes=cfg.test_output_bytes,
                        collect_bytes=cfg.test_reports_bytes)
        model = ModelClient(cfg.agent_url, cfg.agent_model, cfg.agent_api_key) if cfg.agent_url else None
        agent = AgentConfig(cfg.agent_budget, model) if cfg.agent else None
        bases = BaseImages(cfg.base_image, cfg.toolchain_image)
        await self._ensure_bases(cfg, bases, ctx)
        if request.layered:
            images_registry = Registry(cfg.registry, cfg.registry_user, cfg.registry_password)
            event = await build_layered(request, self.store, self.client, bases, images_registry,
                                        settings.cache / "build-work", limits)
        else:
            event = await build_revision(request, self.store, self.client, bases, settings.cache / "build-work",
                                         limits, agent=agent)
        system = event.system or "unknown"
        if event.cached:
            CACHED.inc()
        else:
            BUILDS.labels(system, event.status).inc()
            if event.failure:
                FAILURES.labels(system, event.failure).inc()
            if "total" in event.durations_s:
                SECONDS.labels(system).observe(event.durations_s["total"])
        return event


_builder = _Builder()
stage = Stage(spec.build, _builder.handle, job_timeout_s=6 * 3600, max_attempts=2, registry=registry,
              setup=_builder.setup, teardown=_builder.teardown)
