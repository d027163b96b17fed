"""``lean``: ``lean.requests`` -> results. Run code and tactics on a pool of Lean REPL processes.

Configuration (``KILN_LEAN_*``): ``REPL`` (the command: a ``repl`` binary, or any program speaking its protocol),
``PROJECT`` (a Lake project: its ``LEAN_PATH`` is taken once from ``lake env`` and the REPL runs there),
``MEMORY_MB``, ``RECYCLE_AFTER``, ``IDLE_TTL_S``, ``PREWARM`` (headers to load at start, JSON list of lists),
``INLINE_STATE_KB`` (larger states travel as claim checks), ``EXPORT_EVERY`` (tactics between exports of a proof state;
1 exports every state), ``SANDBOX`` (on: every REPL in bubblewrap, see
``sandbox.py``), ``SANDBOX_READONLY``/``SANDBOX_WRITABLE`` (extra binds), ``PASS_ENV`` (extra variables for the REPL),
``SANDBOX_SPAWN`` / ``SANDBOX_PROC`` (off: no process can be created inside the sandbox, no ``/proc`` there).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.lean import MAX_PATH, LeanRequest, LeanResult
from kiln.streams.blobstore import open_blob_store
from kiln.streams.errors import ConfigError
from kiln.streams.settings import get_settings
from kiln.streams.stage import JobContext, Stage
from kiln.workers.lean import sandbox, spec
from kiln.workers.lean.pool import ReplPool
from kiln.workers.lean.repl import Header, ReplLimits, ReplProcess
from kiln.workers.lean.session import LeanSession, StateCodec


class LeanSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_LEAN_")

    repl: str = Field("repl", description="REPL command line (shell words).")
    project: Path | None = Field(None, description="Lake project directory (search path for imports).")
    memory_mb: int = Field(8192, ge=64, description="RSS bound per REPL process tree.")
    recycle_after: int = Field(1000, ge=1, description="Replace a process after this many requests.")
    idle_ttl_s: float = Field(600.0, gt=0)
    prewarm: list[list[str]] = Field(default_factory=list, description="Headers to load at start.")
    inline_state_kb: int = Field(192, ge=0)
    export_every: int = Field(16, ge=1, le=MAX_PATH, description="Export a proof state once its handle's path "
                              "reaches this many tactics (a miss replays at most this many); 1 exports every state.")
    sandbox: bool = Field(True, description="Run each REPL in a bubblewrap sandbox (sandbox.py). Off only for "
                                            "trusted input: `#eval` can run IO.")
    sandbox_readonly: list[Path] = Field(default_factory=list, description="Extra paths bound read-only into the "
                                                                           "sandbox (toolchain, project and the "
                                                                           "REPL's own tree are bound already).")
    sandbox_writable: list[Path] = Field(default_factory=list, description="Extra paths bound writable (none by "
                                                                           "default).")
    pass_env: list[str] = Field(default_factory=list, description="Worker variables passed into the REPL besides "
                                                                  "Lean's own (LEAN_PATH, ...).")
    sandbox_spawn: bool = Field(False, description="Let the sandboxed REPL create processes. Off: a seccomp rule "
                                                   "refuses fork/clone, so `#eval` cannot start a program that "
                                                   "writes to the REPL's pipes (the REPL must then be its binary, "
                                                   "not `lake env repl`).")
    sandbox_proc: bool = Field(False, description="Mount /proc in the sandbox. Off: the REPL's pipes cannot be "
                                                  "reopened by path (/proc/self/fd/1, /dev/stdout).")


registry = CollectorRegistry()
PROCESSES = Gauge("kiln_lean_repl_processes", "REPL processes alive.", registry=registry)
RETIRED = Counter("kiln_lean_repl_retired_total", "REPL processes retired, by reason (recycled, timeout, crash, "
                  "memory, protocol).", ["reason"], registry=registry)
HEADER = Counter("kiln_lean_header_total", "Requests by whether their header was already loaded.", ["outcome"],
                 registry=registry)
PINNED = Counter("kiln_lean_state_pin_total", "Tactic requests by whether their state was live here.", ["outcome"],
                 registry=registry)
RATIO = Histogram("kiln_lean_state_compression_ratio", "Compressed / raw size of exported proof states.",
                  registry=registry, buckets=(0.01, 0.02, 0.05, 0.08, 0.12, 0.2, 0.35, 0.5, 0.75, 1.0))
REPL_SECONDS = Counter("kiln_lean_repl_seconds_total", "Time in REPL round trips, by operation: code and tactic "
                      "(the requested work), export, import, replay (moving states), fence (the check after "
                      "every reply that it was the REPL's own).", ["op"], registry=registry)
OUTCOMES = Counter("kiln_lean_requests_total", "Requests by operation and Lean outcome.", ["op", "ok"],
                   registry=registry)


class _LeanService:
    def __init__(self) -> None:
        self.session: LeanSession | None = None
        self.pool: ReplPool | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    def _factory(self, settings: LeanSettings, env: dict[str, str], root: Path) -> Callable[[Header], ReplProcess]:
        limits = ReplLimits(memory_bytes=settings.memory_mb << 20, recycle_after=settings.recycle_after)
        command = shlex.split(settings.repl)
        counter = itertools.count()
        if not settings.sandbox:
            return lambda header: ReplProcess(command, header, root / f"p{next(counter)}", limits,
                                              cwd=settings.project, env=env)
        repl_env = sandbox.repl_environment(env, settings.pass_env)
        readonly = [*sandbox.command_paths(command), *settings.sandbox_readonly,
                    *([settings.project] if settings.project else []),
                    *(Path(p) for p in repl_env.get("LEAN_PATH", "").split(":") if p and Path(p).exists())]

        program = None if settings.sandbox_spawn else sandbox.spawn_filter()

        def make(header: Header) -> ReplProcess:
            scratch = root / f"p{next(counter)}"
            scratch.mkdir(parents=True, exist_ok=True)
            fds = (sandbox.filter_pipe(program),) if program is not None else ()
            argv = sandbox.bwrap_command(command, scratch=scratch, readonly=readonly,
                                         writable=settings.sandbox_writable, env=repl_env, cwd=settings.project,
                                         seccomp_fd=fds[0] if fds else None, proc=settings.sandbox_proc)
            return ReplProcess(argv, header, scratch, limits, env={"PATH": env.get("PATH", "/usr/bin:/bin")},
                               pass_fds=fds)

        return make

    async def setup(self, slots: int) -> None:
        settings = LeanSettings()
        env = dict(os.environ)
        if settings.project is not None:
            if not settings.project.is_dir():
                raise ConfigError(f"KILN_LEAN_PROJECT {settings.project} is not a directory")
            lean_path = await asyncio.to_thread(
                subprocess.run, ["lake", "env", "printenv", "LEAN_PATH"], cwd=settings.project, capture_output=True,
                text=True, timeout=600)
            if lean_path.returncode == 0:
                env["LEAN_PATH"] = lean_path.stdout.strip()
        if settings.sandbox and not settings.sandbox_spawn and "LEAN_SYSROOT" not in env and shutil.which("lean"):
            # Lean.findSysroot runs `lean --print-prefix` unless LEAN_SYSROOT is set; inside, it could not.
            prefix = await asyncio.to_thread(subprocess.run, ["lean", "--print-prefix"], cwd=settings.project,
                                             capture_output=True, text=True, timeout=120)
            if prefix.returncode == 0 and prefix.stdout.strip():
                env["LEAN_SYSROOT"] = prefix.stdout.strip()
        if settings.sandbox:
            await asyncio.to_thread(sandbox.check_available, not settings.sandbox_spawn)
        self._workdir = tempfile.TemporaryDirectory(prefix="kiln-lean-")
        self.pool = ReplPool(self._factory(settings, env, Path(self._workdir.name)), size=slots,
                             idle_ttl_s=settings.idle_ttl_s, on_retire=lambda reason: RETIRED.labels(reason).inc())
        self.pool.start()
        blobs = open_blob_store(get_settings())
        self.session = LeanSession(self.pool, StateCodec(blobs, settings.inline_state_kb * 1024),
                                   settings.export_every, lambda op, seconds: REPL_SECONDS.labels(op).inc(seconds))
        await self.pool.prewarm([tuple(h) for h in settings.prewarm])

    async def teardown(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self._workdir is not None:
            self._workdir.cleanup()

    def gauges(self) -> dict[str, float]:
        """REPL processes alive, in all and per header (its imports), for the status page."""
        if self.pool is None:
            return {"repl_processes": 0.0}
        levels = {"repl_processes": float(self.pool.processes)}
        for header, count in self.pool.headers(leased=True).items():
            levels[f"repl_processes[{','.join(header)[:80] or 'no imports'}]"] = float(count)
        return levels

    async def handle(self, request: LeanRequest, ctx: JobContext) -> LeanResult:
        if self.session is None or self.pool is None:
            await self.setup(os.cpu_count() or 1)
        assert self.session is not None and self.pool is not None
        affinity = ctx.key or ctx.envelope.request_id
        try:
            result = await self.session.run(request, affinity)
        finally:
            PROCESSES.set(self.pool.processes)
        HEADER.labels("hit" if result.header_reused else "miss").inc()
        if request.op == "run_tactic":
            PINNED.labels("hit" if result.state_pinned else "miss").inc()
        for ref in [s.state for s in result.sorries] + ([result.state] if result.state else []):
            if ref.exported and ref.raw_bytes:
                RATIO.observe(ref.stored_bytes / ref.raw_bytes)
        OUTCOMES.labels(request.op, str(result.ok).lower()).inc()
        return result


service = _LeanService()
stage = Stage(spec.lean, service.handle, max_attempts=3, registry=registry, setup=service.setup,
              teardown=service.teardown, gauges=service.gauges)
