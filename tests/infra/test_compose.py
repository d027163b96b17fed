"""docker-compose.yml is valid, and its worker image builds from the local base and serves jobs."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from testcontainers.core.container import DockerContainer

from kiln.schemas.builtin import EchoRequest
from kiln.streams.client import KilnClient
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid_and_complete() -> None:
    compose = shutil.which("docker-compose")
    assert compose, "Debian's docker-compose is installed by kiln setup docker"
    # No credential has a committed default: without them the file refuses to render.
    refused = subprocess.run([compose, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True,
                             text=True, check=False, env={"PATH": os.environ["PATH"]})
    assert refused.returncode != 0 and "KILN_S3_SECRET_KEY" in refused.stderr + refused.stdout
    env = {"PATH": os.environ["PATH"], "KILN_S3_ACCESS_KEY": "k" * 8, "KILN_S3_SECRET_KEY": "s" * 24,
           "KILN_SAUCER_TOKEN": "t" * 24, "KILN_GATEWAY_API_KEY": "g" * 24}
    rendered = subprocess.run([compose, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True,
                              text=True, check=True, env=env).stdout
    services = yaml.safe_load(rendered)["services"]
    assert {"redpanda", "s3", "registry", "prometheus", "worker-echo", "worker-sleep", "topics",
            "worker-ingest", "saucer", "worker-build", "worker-exec", "gateway", "stats", "status",
            "grafana"} <= set(services)
    build = services["worker-echo"]["build"]
    assert build["network"] == "host" and build["args"]["BASE_IMAGE"] == "python:3.11-slim"
    assert services["registry"]["environment"]["REGISTRY_STORAGE"] == "s3"


@pytest.fixture(scope="module")
def worker_image(docker_engine: Any) -> str:
    _image, _ = docker_engine.images.build(
        path=str(ROOT), dockerfile="infra/docker/worker.Dockerfile", tag="kiln/worker:test",
        buildargs={"BASE_IMAGE": "kiln/base:latest"}, network_mode="host", rm=True,
    )
    return "kiln/worker:test"


async def test_worker_image_serves_jobs_through_the_broker(worker_image: str, kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                           unique: str) -> None:
    request_topic, results = topics(partitions=2)
    port = free_port()
    container = (DockerContainer(worker_image)
                 .with_kwargs(network_mode="host")
                 .with_env("KILN_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
                 .with_env("KILN_METRICS_PORT", str(port))
                 .with_command(f"worker echo --topic {request_topic} --group g-{unique}"))
    with container:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/healthz", timeout=1)
                if health.json()["status"] == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, container.get_logs()
            await asyncio.sleep(0.3)
        async with KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
            envelope = await asyncio.wait_for(
                await client.submit("echo", EchoRequest(data="from a container"), topic=request_topic), 30)
        user = container.get_wrapped_container().exec_run("id -u").output.decode().strip()
    assert client.result_of(envelope).data == "from a container"
    assert user == "1000"
