"""Sessions on images by registry digest, as a node that never built them: the exec worker pulls the image, runs
the session, and evicts what it pulled beyond its bound (least recently used first)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.builder.revisions import push
from kiln.workers.common.registry import Registry
from kiln.workers.exec.client import ExecClient
from tests.workers.exec.conftest import exec_worker

pytestmark = [pytest.mark.docker, pytest.mark.registry]


def _forget(docker_engine: Any, reference: str) -> None:
    """Make the engine lack ``reference`` (as a fresh node would): untag the name and its digest."""
    name = reference.split("@")[0]
    for tag in docker_engine.images.get(reference).tags:
        if tag.startswith(name):
            docker_engine.images.remove(tag)
    with pytest.raises(docker.errors.ImageNotFound):
        docker_engine.images.get(reference)


async def test_sessions_pull_by_digest_and_evict_what_they_pulled(
        project_image: str, exec_settings: KilnSettings, registry: Registry, docker_engine: Any, unique: str,
        tmp_path: Path) -> None:
    refs = [await push(docker_engine, registry, project_image, f"kiln/pull-{unique}-{i}", "t") for i in range(2)]
    for ref in refs:
        _forget(docker_engine, ref)
    env = {"KILN_EXEC_REGISTRY": registry.address, "KILN_EXEC_REGISTRY_USER": registry.user,
           "KILN_EXEC_REGISTRY_PASSWORD": registry.password, "KILN_EXEC_PULLED_IMAGES_MAX": "1",
           "KILN_EXEC_WARM_IMAGES": "0", "KILN_EXEC_IMAGE_PREFIXES": json.dumps(["kiln/", f"{registry.address}/kiln/"])}
    with exec_worker(exec_settings, tmp_path / "locks", **env) as worker:
        worker.wait_assigned()
        async with KilnClient(exec_settings, "puller") as kiln:
            client = ExecClient(kiln)
            for ref in refs:
                session = await client.open_session(ref)
                out = await client.run(session, "id -u && ls /work")
                assert out.exit_code == 0 and out.stdout.startswith("1000\n"), out
                await client.close_session(session)
            await asyncio.sleep(0.5)
    docker_engine.images.get(refs[1])  # the latest pull stays
    with pytest.raises(docker.errors.ImageNotFound):
        docker_engine.images.get(refs[0])  # beyond the bound of 1, and idle: evicted
