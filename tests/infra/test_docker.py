"""The Docker engine runs kiln's locally built images; containers get no network unless they ask for the host's."""

from __future__ import annotations

from typing import Any


def test_container_without_network_has_only_loopback(docker_engine: Any) -> None:
    out = docker_engine.containers.run(
        "kiln/base:latest", ["sh", "-c", "ls /sys/class/net; id -u kiln"],
        network_mode="none", remove=True, user="root",
    ).decode()
    interfaces, uid = out.split()[:-1], out.split()[-1]
    assert interfaces == ["lo"]
    assert uid == "1000"


def test_toolchain_image_has_host_toolchains(docker_engine: Any) -> None:
    out = docker_engine.containers.run(
        "kiln/toolchain:latest",
        ["sh", "-c", "go version && rustc --version && cargo --version && python3 --version && node --version"],
        network_mode="none", remove=True,
    ).decode()
    assert "go version go1." in out
    assert "rustc 1." in out and "cargo 1." in out
    assert "Python 3." in out and "v2" in out


def test_every_container_gets_no_new_privileges(docker_engine: Any) -> None:
    """The engine's default (dockerd --no-new-privileges): also a repository Dockerfile's RUN steps, which the
    build API runs without any security option kiln could pass."""
    out = docker_engine.containers.run("kiln/base:latest", ["grep", "NoNewPrivs", "/proc/self/status"],
                                       network_mode="none", remove=True)
    assert out.decode().split() == ["NoNewPrivs:", "1"]
