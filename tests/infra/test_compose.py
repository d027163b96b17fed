"""docker-compose.yml as Compose v2 reads it (the plugin `kiln setup compose` builds): it refuses to start without
per-installation credentials, renders the whole stack with a hub, and with infra/compose/no-hub.yml names no image a
hub would have to serve. The stack itself runs in tests/infra/test_compose_stack.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.streams.infra import COMPONENT_STEPS, run_steps

ROOT = Path(__file__).resolve().parents[2]
CREDENTIALS = {"KILN_S3_ACCESS_KEY": "k" * 8, "KILN_S3_SECRET_KEY": "s" * 24, "KILN_SAUCER_TOKEN": "t" * 24,
               "KILN_GATEWAY_API_KEY": "g" * 24}
KILN_SERVICES = {"topics", "worker-echo", "worker-sleep", "worker-ingest", "worker-verify", "worker-build",
                 "worker-exec", "saucer", "gateway", "stats", "status"}


@pytest.fixture(scope="module")
def compose() -> None:
    run_steps(COMPONENT_STEPS["compose"][:1])  # the plugin only


def render(*files: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    args = [a for f in ("docker-compose.yml", *files) for a in ("-f", f)]
    return subprocess.run(["docker", "compose", *args, "config"], cwd=ROOT, capture_output=True, text=True,
                          check=False, env={"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], **env})


def services(*files: str) -> dict[str, Any]:
    done = render(*files, env=CREDENTIALS)
    assert done.returncode == 0, done.stderr
    rendered: dict[str, Any] = yaml.safe_load(done.stdout)["services"]
    return rendered


def test_no_credential_has_a_committed_default(compose: None) -> None:
    for missing in CREDENTIALS:
        refused = render(env={k: v for k, v in CREDENTIALS.items() if k != missing})
        assert refused.returncode != 0 and missing in refused.stderr + refused.stdout, missing


def test_with_a_hub_the_broker_is_redpanda_with_both_listeners(compose: None) -> None:
    hub = services()
    assert KILN_SERVICES | {"broker", "s3", "registry", "egress", "egress-check", "prometheus", "grafana"} <= set(hub)
    assert hub["broker"]["image"].startswith("docker.redpanda.com/")
    addresses = " ".join(hub["broker"]["command"])
    assert "internal://broker:29092" in addresses and "external://127.0.0.1:9092" in addresses
    # One image for every kiln service, built once (by `topics`), with the extras its services import.
    assert {hub[s]["image"] for s in KILN_SERVICES} == {"kiln/worker:latest"}
    assert [s for s in KILN_SERVICES if "build" in hub[s]] == ["topics"]
    assert hub["topics"]["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim",
                                               "TOOLCHAIN_IMAGE": "golang:1.23-bookworm"}
    assert "[worker,ops,s3]" in (ROOT / "infra/docker/worker.Dockerfile").read_text()


def test_without_a_hub_every_image_is_built_here(compose: None) -> None:
    local = services("infra/compose/no-hub.yml")
    assert "grafana" not in local  # Debian ships no Grafana: left out by its profile
    images = {name: service["image"] for name, service in local.items()}
    assert all(image.startswith("kiln/") for image in images.values()), images
    assert local["topics"]["build"]["args"] == {"BASE_IMAGE": "kiln/base:latest",
                                                 "TOOLCHAIN_IMAGE": "kiln/toolchain:latest"}
    assert local["egress"]["build"]["args"] == {"BASE_IMAGE": "kiln/base:latest"}
    assert "command" not in local["broker"] and local["broker"]["image"] == "kiln/stack-kafka:local"


def test_untrusted_code_never_shares_a_network_with_kiln(compose: None) -> None:
    hub = services()
    # Build steps: the egress network only, internal, labelled as kiln's egress network; its one member here is
    # the boundary check. The engine-driving workers are trusted and on the host's network; nothing else joins it.
    assert [name for name, s in hub.items() if "egress" in s.get("networks", {})] == ["egress-check"]
    assert {name for name, s in hub.items() if s.get("network_mode") == "host"} == {
        "worker-build", "worker-exec", "egress"}
    assert hub["worker-build"]["environment"]["KILN_BUILD_NETWORK"] == "kiln-stack-egress"
    network = yaml.safe_load(render(env=CREDENTIALS).stdout)["networks"]["egress"]
    assert network["internal"] is True and network["labels"] == {"kiln.role": "egress"}
    # Every published port binds to loopback.
    published = [p for s in hub.values() for p in s.get("ports", [])]
    assert published and all(p["host_ip"] == "127.0.0.1" for p in published), published
