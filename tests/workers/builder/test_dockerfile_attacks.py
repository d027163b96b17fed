"""A repository's own Dockerfile, tried as an attacker would: dockerd performs some instructions itself, on the host's
behalf (``ADD`` of a URL on the host's network, ``COPY --from`` and ``FROM`` out of its whole image store), and writes
``USER``, ``VOLUME``, ``LABEL``, ``HEALTHCHECK`` and ``ONBUILD`` into the image kiln's other stages trust. Each
attack goes through the real builder and the real engine; none gets through (``workers/builder/dockerfile.py``)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.images import ImageContract
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.errors import InfraError
from kiln.streams.processes import free_port
from kiln.workers.builder import images
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits
from tests.ingest.gitrepos import Builder, write
from tests.workers.builder.servers import counting_server

pytestmark = pytest.mark.docker
BASES = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
SECRET = b"another repository's secret"


@pytest.fixture
def host_server() -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on every address of this machine (loopback included), counting requests."""
    with counting_server(SECRET) as server:
        yield server


@pytest.fixture
def victim_image(docker_engine: Any) -> Iterator[str]:
    """Another repository's built image in the same engine, holding a secret (tagged the way the builder tags), and
    the same image under a bare name a stage could be named after."""
    container = docker_engine.containers.create("kiln/base:latest", ["bash", "-c", f"echo '{SECRET.decode()}' > "
                                                                                   "/secret"], network_mode="none")
    container.start()
    container.wait()
    tag = f"kiln/build/victim-{free_port()}"
    container.commit(repository=tag, tag="r4")
    container.commit(repository="victim", tag="latest")
    container.remove(force=True)
    yield f"{tag}:r4"
    for name in (f"{tag}:r4", "victim:latest"):
        docker_engine.images.remove(name, force=True)


async def _build(docker: Any, tmp_path: Path, name: str, files: dict[str, str | bytes],
                 run_tests: bool = False) -> BuildEvent:
    src = tmp_path / name.replace("/", "-")
    b = Builder(src)
    for path, data in files.items():
        write(src, path, data)
    b.commit("an attacking Dockerfile")
    store = SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")
    await ingest(IngestRequest(name=name, location=str(src)), "r", store, tmp_path / "w")
    return await build_revision(BuildRequest(repository=name, force=True, run_tests=run_tests), store, docker, BASES,
                                tmp_path / "w", Limits(timeout_s=120))


REMOTE_ADD = {
    "plain": "FROM debian:bookworm\nADD http://127.0.0.1:{port}/plain /stolen\n",
    "json-form": 'FROM debian:bookworm\nADD ["http://127.0.0.1:{port}/json", "/stolen"]\n',
    "lower-case": "from debian:bookworm\nadd --chown=0:0 http://127.0.0.1:{port}/lower /stolen\n",
    "build-argument": "ARG U=http://127.0.0.1:{port}/arg\nFROM debian:bookworm\nARG U\nADD $U /stolen\n",
    "continued-line": "FROM debian:bookworm\nADD ht\\\n# a comment in the continuation\ntp://127.0.0.1:{port}/c /s\n",
    "escape-directive": "# escape=`\nFROM debian:bookworm\nADD ht`\ntp://127.0.0.1:{port}/escape /stolen\n",
    "env-variable": "FROM debian:bookworm\nENV H=127.0.0.1:{port}\nADD http://${{H}}/env /stolen\n",
    "run-network-host": "FROM debian:bookworm\nRUN --network=host curl -s http://127.0.0.1:{port}/run > /stolen\n",
}


@pytest.mark.parametrize("variant", sorted(REMOTE_ADD))
async def test_remote_add_never_reaches_the_host_network(docker_engine: Any, host_server: tuple[int, list[str]],
                                                         tmp_path: Path, variant: str) -> None:
    port, hits = host_server
    event = await _build(docker_engine, tmp_path, f"attack/add-{variant}",
                         {"Dockerfile": REMOTE_ADD[variant].format(port=port)})
    assert event.status == "failed" and event.failure == "no_rule_matched", event
    detail = event.detail or ""
    assert ("Dockerfile ADD" in detail and "host's network" in detail) or "RUN takes no flags" in detail, detail
    assert hits == [], f"dockerd fetched {hits} from this machine"


COPY_FROM = {
    "copy-from-image": "FROM debian:bookworm\nCOPY --from={victim} /secret /stolen\n",
    "from-image": "FROM {victim}\nRUN cat /secret\n",
    "copy-from-argument": "ARG V={victim}\nFROM debian:bookworm\nARG V\nCOPY --from=$V /secret /stolen\n",
    # A stage named like an image, copied from inside itself: dockerd would look the name up as an image.
    "stage-named-like-an-image": "FROM debian:bookworm AS victim\nCOPY --from=victim /secret /stolen\n",
    "later-stage": "FROM debian:bookworm AS a\nCOPY --from=b /secret /stolen\nFROM debian:bookworm AS b\n",
    "run-mount-from-image": "FROM debian:bookworm\nRUN --mount=type=bind,from={victim},target=/v cat /v/secret\n",
}


@pytest.mark.parametrize("variant", sorted(COPY_FROM))
async def test_no_instruction_reads_another_repositorys_image(docker_engine: Any, victim_image: str,
                                                               tmp_path: Path, variant: str) -> None:
    event = await _build(docker_engine, tmp_path, f"attack/{variant}",
                         {"Dockerfile": COPY_FROM[variant].format(victim=victim_image)})
    assert event.status == "failed" and event.failure == "no_rule_matched", event
    assert event.image is None
    assert any(why in str(event.detail) for why in ("only an earlier stage", "no local image", "RUN takes no flags"))
    assert SECRET.decode() not in str(event.detail)


def _setuid_tarball() -> bytes:
    """A tarball holding a setuid-root copy of bash, which ``ADD`` would unpack as root."""
    buffer = io.BytesIO()
    data = Path("/bin/bash").read_bytes()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("rootsh")
        info.size, info.mode, info.uid, info.gid = len(data), 0o4755, 0, 0
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


PROOF = "/tmp/proof.txt"
FORGED_TEST = f"{ImageContract.LABELS['test']}=forged"  # the image contract's test command, forged
ROOT_DOCKERFILE = f"""FROM debian:bookworm
USER root
LABEL kiln.role=exec-session kiln.lock=/etc/passwd kiln.lockns=host kiln.worker=evil {FORGED_TEST} other=x
VOLUME /data /work
HEALTHCHECK --interval=1s CMD touch /tmp/health
ONBUILD RUN touch /tmp/onbuild
ADD root.tar /opt/
RUN echo "uid $(id -u)" > {PROOF} && grep -E '^Cap(Eff|Prm):' /proc/self/status >> {PROOF}
USER 0:0
RUN echo "uid $(id -u)" >> {PROOF}; ls -n /opt >> {PROOF}; \\
    tar -xf /opt/root.tar -C /tmp && /tmp/rootsh -p -c 'echo "setuid-shell euid $(id -u)"' >> {PROOF}; true
"""


async def test_the_project_build_never_runs_as_root_and_the_image_carries_only_kiln_labels(
        docker_engine: Any, tmp_path: Path) -> None:
    event = await _build(docker_engine, tmp_path, "attack/root",
                         {"Dockerfile": ROOT_DOCKERFILE, "root.tar": _setuid_tarball()})
    assert event.status == "built" and event.recipe == "dockerfile" and event.image, event.detail
    topics = {d.topic for d in event.decisions}
    assert {"dockerfile user", "dockerfile add", "dockerfile volume", "dockerfile label", "dockerfile healthcheck",
            "dockerfile onbuild"} <= topics, topics
    image = docker_engine.images.get(event.image)
    config = image.attrs["Config"]
    assert not config.get("Volumes") and not config.get("OnBuild") and not config.get("Healthcheck"), config
    labels = config.get("Labels") or {}
    assert not {"kiln.role", "kiln.lock", "kiln.lockns", "kiln.worker", "other"} & set(labels), labels
    assert ImageContract.from_labels(labels).test != "forged" and labels["kiln.repository"] == "attack/root"
    assert config["User"] == "1000:1000"
    proof = docker_engine.containers.run(event.image, ["cat", PROOF], network_mode="none", remove=True).decode()
    lines = proof.splitlines()
    assert lines[0] == "uid 1000" and "CapEff:\t0000000000000000" in lines, proof
    assert lines.count("uid 1000") == 2 and "uid 0" not in lines, proof
    # The tarball was copied, not unpacked by dockerd as root; unpacked by the build user, its setuid bit is void.
    assert any(line.endswith(" root.tar") and " 1000 1000 " in line for line in lines), proof
    assert "setuid-shell euid 1000" in lines, proof


def test_an_image_declaring_volumes_or_kiln_labels_is_refused(docker_engine: Any) -> None:
    """The check every built image passes (the last line of defence behind the Dockerfile's rewriting)."""
    container = docker_engine.containers.create("kiln/base:latest", ["true"], network_mode="none")
    tag = f"kiln/forged-{free_port()}"
    try:
        container.commit(repository=tag, tag="x", conf={"Volumes": {"/data": {}},
                                                        "Labels": {"kiln.role": "exec-session"}})
        image = docker_engine.images.get(f"{tag}:x")
        with pytest.raises(InfraError, match=r"declares volumes \['/data'\], labels \{'kiln.role'"):
            images.check_image(docker_engine, image, {"kiln.repository": "r"})
        assert not images.image_exists(docker_engine, f"{tag}:x")
    finally:
        container.remove(force=True)
