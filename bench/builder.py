"""Build every generated project (one per build system, plus the ambiguous and broken ones) through the builder
on real Docker: cold (``force``: no build cache, a fresh dependency image, no Docker layer cache) and cached (the
same revision asked again).

These are fixtures written alongside the rules (tests/workers/builder/projects.py), so their success rate says that
the rules do what they were written to do, not how the builder fares on real repositories. Prints
``build_success_rate_fixtures`` (usable builds / fixtures that should build), ``build_s_<system>`` (cold) and
``build_s_<system>_cached`` per fixture.
Usage: python -m bench.builder
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from bench.common import report
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits, docker_client
from tests.workers.builder.projects import PROJECTS

SHOULD_FAIL = {"broken-compile", "broken-deps", "no-rule"}


async def main() -> None:
    run_steps(COMPONENT_STEPS["docker"])
    client = docker_client()
    bases = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
    limits = Limits(memory_bytes=1 << 30, timeout_s=600)
    metrics: dict[str, float] = {}
    usable = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
        for name, make in PROJECTS.items():
            make(root / "src" / name)
            await ingest(IngestRequest(name=f"bench/{name}", location=str(root / "src" / name)), name, store,
                         root / "work")
        for name in PROJECTS:
            # Cold: force = no build cache, a fresh dependency image, no Docker layer cache.
            request = BuildRequest(repository=f"bench/{name}", force=True)
            started = time.monotonic()
            event = await build_revision(request, store, client, bases, root / "work", limits)
            metrics[f"build_s_{name}"] = round(time.monotonic() - started, 2)
            started = time.monotonic()
            cached = await build_revision(request.model_copy(update={"force": False}), store, client, bases,
                                          root / "work", limits)
            metrics[f"build_s_{name}_cached"] = round(time.monotonic() - started, 3)
            assert cached.cached
            if name not in SHOULD_FAIL and event.usable:
                usable += 1
            metrics[f"build_ok_{name}"] = float(event.usable if name not in SHOULD_FAIL else
                                                event.failure is not None)
    metrics = {"build_success_rate_fixtures": round(usable / (len(PROJECTS) - len(SHOULD_FAIL)), 3), **metrics}
    report("builder: generated fixture projects (written to match the rules), cold and cached", metrics)


if __name__ == "__main__":
    asyncio.run(main())
