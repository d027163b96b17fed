"""Real images with the Docker SDK: a dependency image keyed by the hash of the dependency manifests, then the
project image (sources + build) on top of it, or the repository's own Dockerfile (confined by ``dockerfile.py``).
Every step runs in the build sandbox (``sandbox.py``: kiln's egress network, registries only through the
allowlisting proxy, bounded); every step that runs repository code runs as the unprivileged user (the dependency
step included: the tool directories it fills are made its own first); tests run without any network. A built
image is checked before anything uses it: no volumes, no triggers, no health check, and no ``kiln.*`` label kiln
did not set."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound

from kiln.schemas.images import REPORTS_DIR, ImageContract
from kiln.streams import cancel
from kiln.streams.errors import InfraError
from kiln.workers.builder.errors import StepFailed
from kiln.workers.builder.rules import LOCAL_IMAGE_MARK, RULES_VERSION, Plan
from kiln.workers.builder.sandbox import UNPRIVILEGED, BuildSandbox
from kiln.workers.common.containers import OutputTail

# Where the dependency step leaves tools and caches: created for the unprivileged user by kiln's own root step
# (no repository code in it), so the dependency install, the project's build, later rebuilds and tests all run as
# that user (/opt/cargo-home is world-writable in the toolchain image already).
TOOL_DIRS = "/work /opt/venv /opt/c8 /opt/gopath /opt/kiln-js /opt/m2 /opt/gradle"
MAKE_TOOL_DIRS = f"mkdir -p {TOOL_DIRS} && chown {UNPRIVILEGED} {TOOL_DIRS}"
# Go's module cache outside any home directory, so root (dependencies) and uid 1000 (build, tests) share it.
TOOL_ENV = "ENV GOPATH=/opt/gopath GOFLAGS=-modcacherw\n"


def repository_slug(repository: str, limit: int) -> str:
    """A repository name as a Docker image-name component (lower case, ``[a-z0-9._-]``, at most ``limit``)."""
    return re.sub(r"[^a-z0-9._-]+", "-", repository.lower()).strip("-.")[:limit] or "repo"


@dataclass(frozen=True)
class BaseImages:
    base: str
    toolchain: str


def image_exists(client: Any, tag: str) -> bool:
    try:
        client.images.get(tag)
    except ImageNotFound:
        return False
    except (APIError, DockerException) as e:
        raise InfraError(f"inspecting {tag}: {e}") from e
    return True


def _env_lines(env: dict[str, str]) -> str:
    return "".join(f"ENV {k}={json.dumps(v)}\n" for k, v in sorted(env.items()))


def _run(script: str) -> str:
    # The exec form: the shell form would hand the script to /bin/sh inside double quotes, expanding its $ first.
    # no_new_privs through util-linux's setpriv, as the engine's /build takes no security options: kiln's own
    # recipe copies files into /work only, so nothing of the repository's can stand in for setpriv.
    return f"RUN {json.dumps(['setpriv', '--no-new-privs', 'bash', '-c', script])}\n"


def build(client: Any, context: Path, dockerfile: str, tag: str, timeout_s: float,
          labels: dict[str, str] | None = None, nocache: bool = False, inherited: dict[str, str] | None = None) -> str:
    """``docker build`` in the build sandbox; returns the image id. Raises StepFailed with the build log.
    ``inherited``: the labels of a kiln-built image the recipe starts from (checked when that image was built)."""
    sandbox = BuildSandbox()
    sandbox.verify(client)
    (context / "Dockerfile.kiln").write_text(dockerfile)
    # Its own read timeout bounds the build; the engine cancels a build whose client went away.
    api = docker.from_env(timeout=max(1, int(timeout_s))).api
    cancel.on_cancel(api.close)  # a given-up job's build: the engine stops a build whose client went away
    log = OutputTail(sandbox.log_bytes)
    try:
        # The engine's /build endpoint directly: the SDK's build() has no parameter for the parent cgroup.
        # version 1: the classic builder, whose instructions ``dockerfile.confine`` reasons about (BuildKit would
        # also honour a ``# syntax`` frontend image and RUN mounts of other images).
        params = {"t": tag, "dockerfile": "Dockerfile.kiln", "rm": True, "forcerm": True, "nocache": nocache,
                  "version": "1",
                  "labels": json.dumps(labels or {}), **sandbox.build_params()}
        with docker.utils.tar(str(context), gzip=False) as archive:
            response = api._post(api._url("/build"), data=archive, params=params, stream=True,
                                 headers={"Content-Type": "application/tar"})
        api._raise_for_status(response)
        for chunk in api._stream_helper(response, decode=True):
            if "stream" in chunk:
                log.add(str(chunk["stream"]))
            if "error" in chunk:
                log.add(str(chunk["error"]))
                raise StepFailed(log.text())
    except StepFailed:
        raise
    except (APIError, DockerException) as e:
        raise InfraError(f"docker build {tag}: {e}") from e
    except Exception as e:  # the HTTP read timed out: the build ran past its budget
        if "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower():
            raise StepFailed(log.text() + f"\nbuild ran past {timeout_s:.0f}s", timed_out=True) from None
        raise InfraError(f"docker build {tag}: {e}") from e
    finally:
        api.close()
    image = client.images.get(tag)
    check_image(client, image, {**(inherited or {}), **(labels or {})})
    return str(image.id)


def check_image(client: Any, image: Any, labels: dict[str, str]) -> None:
    """Refuse (and remove) a built image that declares what kiln's other stages must never see from a repository:
    volumes, ONBUILD triggers, a health check, or a ``kiln.*`` label kiln did not set to that value."""
    config = image.attrs.get("Config") or {}
    forged = {k: v for k, v in (config.get("Labels") or {}).items() if k.startswith("kiln.") and labels.get(k) != v}
    problems = [f"volumes {sorted(config['Volumes'])}" if config.get("Volumes") else "",
                f"ONBUILD {config['OnBuild']}" if config.get("OnBuild") else "",
                "a health check" if (config.get("Healthcheck") or {}).get("Test") else "",
                f"labels {forged}" if forged else ""]
    if any(problems):
        with contextlib.suppress(APIError, DockerException):
            client.images.remove(image.id, force=True)
        raise InfraError(f"built image {image.id[:19]} declares {', '.join(p for p in problems if p)}: refused")


# Debian packages a plan needs beyond the toolchain (Plan.packages), installed by kiln's own recipe (root, no
# repository code) from deb.debian.org through the egress proxy.
_PACKAGES = ("RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
             "{packages} && rm -rf /var/lib/apt/lists/*\n")


def toolchain_image(client: Any, toolchain: str, packages: list[str], timeout_s: float) -> str:
    """The toolchain image with ``packages`` added: a layer built the first time a plan asks for that set (a JDK
    and Maven; meson and ninja), keyed by the toolchain image and the set, so only projects that need it pay for
    it (build time, disk); ``toolchain`` itself without any."""
    if not packages:
        return toolchain
    toolchain_id = client.images.get(toolchain).id
    dockerfile = f"FROM {toolchain}\n" + _PACKAGES.format(packages=" ".join(sorted(set(packages))))
    key = hashlib.sha256(json.dumps([toolchain_id, dockerfile]).encode()).hexdigest()[:20]
    tag = f"kiln/toolchain-extra:{key}"
    if image_exists(client, tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="kiln-toolchain-") as tmp:
        build(client, Path(tmp), dockerfile, tag, timeout_s, {"kiln.role": "toolchain"})
    return tag


def dependency_image(client: Any, plan: Plan, checkout: Path, bases: BaseImages, timeout_s: float,
                     fresh: bool = False) -> tuple[str, bool]:
    """The dependency image for ``plan`` (built unless one with the same key exists, or ``fresh``); returns
    (tag, cached)."""
    toolchain = toolchain_image(client, bases.toolchain, plan.packages, timeout_s)
    toolchain_id = client.images.get(toolchain).id  # the tag moves when the toolchain image is rebuilt
    dockerfile = (f"FROM {toolchain}\n{TOOL_ENV}{_env_lines(plan.env)}{_run(MAKE_TOOL_DIRS)}WORKDIR /work\n"
                  f"COPY --chown={UNPRIVILEGED} manifests/ /work/\nUSER {UNPRIVILEGED}\n{_run(plan.deps_script)}")
    # The recipe itself is part of the key: a change to how dependency images are made never reuses old ones.
    key = hashlib.sha256(json.dumps([RULES_VERSION, plan.system, toolchain_id, dockerfile,
                                     [(m, hashlib.sha256((checkout / m).read_bytes()).hexdigest())
                                      for m in sorted(plan.manifests)]]).encode()).hexdigest()[:20]
    tag = f"kiln/deps-{plan.system}:{key}"
    if not fresh and image_exists(client, tag):
        return tag, True
    with tempfile.TemporaryDirectory(prefix="kiln-deps-") as tmp:
        ctx = Path(tmp)
        (ctx / "manifests").mkdir()
        for m in plan.manifests:
            target = ctx / "manifests" / m
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(checkout / m, target)
        labels = {"kiln.role": "dependencies", **ImageContract(system=plan.system).to_labels()}
        build(client, ctx, dockerfile, tag, timeout_s, labels, nocache=fresh)
    return tag, False


def project_image(client: Any, plan: Plan, checkout: Path, base_tag: str, tag: str, labels: dict[str, str],
                  timeout_s: float, fresh: bool = False) -> str:
    """Sources and the build on top of the dependency image, built by the unprivileged user who owns the tree."""
    with tempfile.TemporaryDirectory(prefix="kiln-src-") as tmp:
        ctx = Path(tmp)
        shutil.copytree(checkout, ctx / "src", symlinks=True)
        dockerfile = (f"FROM {base_tag}\n{_env_lines(plan.env)}WORKDIR /work\nCOPY --chown=1000:1000 src/ /work/\n"
                      f"USER {UNPRIVILEGED}\n{_run(plan.build_script)}")
        return build(client, ctx, dockerfile, tag, timeout_s, labels, nocache=fresh,
                     inherited=dict(client.images.get(base_tag).labels or {}))


def dockerfile_image(client: Any, plan: Plan, checkout: Path, bases: BaseImages, tag: str, labels: dict[str, str],
                     timeout_s: float, fresh: bool = False) -> str:
    assert plan.dockerfile is not None
    text = plan.dockerfile.replace(LOCAL_IMAGE_MARK + "toolchain", bases.toolchain).replace(
        LOCAL_IMAGE_MARK + "base", bases.base)
    with tempfile.TemporaryDirectory(prefix="kiln-df-") as tmp:
        ctx = Path(tmp) / "ctx"
        shutil.copytree(checkout, ctx, symlinks=True)
        return build(client, ctx, text, tag, timeout_s, labels, nocache=fresh)


# Systems whose test command runs what was built without rebuilding it (CTest runs the binaries under build/; a
# Makefile's test binary may be run directly). A revision's tests must judge its sources as they are when they run:
# a patch applied in a session (a verifier's completion, a task's gold patch) is compiled first, or the run would
# score the unpatched code. Their builds are incremental: on an unchanged tree the rebuild does nothing.
_REBUILD_FIRST = ("cmake", "make")


def test_command(plan: Plan) -> str:
    if plan.recipe == "dockerfile":
        return f"mkdir -p {REPORTS_DIR} && {plan.test_script}"
    # A subshell: a build script that changes directory (a project in a subdirectory) leaves the test's alone.
    rebuild = f"({plan.build_script}) >&2 || exit $?; " if plan.system in _REBUILD_FIRST else ""
    return f"mkdir -p {REPORTS_DIR} && cd /work || exit $?; {rebuild}{plan.test_script}"
