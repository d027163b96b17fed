"""Real images with the Docker SDK: a dependency image keyed by the hash of the dependency manifests, then the
project image (sources + build) on top of it, or the repository's own Dockerfile. Builds use the host network
(dependency downloads); tests never do."""

from __future__ import annotations

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

from kiln.streams.errors import InfraError
from kiln.workers.builder.errors import StepFailed
from kiln.workers.builder.rules import LOCAL_IMAGE_MARK, RULES_VERSION, Plan

# Give what the build created to the test user without touching (and so copying into the layer) the rest.
HAND_OVER = "find /work ! -user 1000 -exec chown -h 1000:1000 {} +"


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
    return f"RUN bash -c {json.dumps(script)}\n"


def build(client: Any, context: Path, dockerfile: str, tag: str, timeout_s: float,
          labels: dict[str, str] | None = None, nocache: bool = False) -> str:
    """``docker build`` with host networking; returns the image id. Raises StepFailed with the build log."""
    (context / "Dockerfile.kiln").write_text(dockerfile)
    api = docker.from_env(timeout=max(1, int(timeout_s))).api  # its own read timeout bounds the build
    log: list[str] = []
    try:
        for chunk in api.build(path=str(context), dockerfile="Dockerfile.kiln", tag=tag, network_mode="host",
                               rm=True, forcerm=True, decode=True, labels=labels or {}, nocache=nocache):
            if "stream" in chunk:
                log.append(str(chunk["stream"]))
            if "error" in chunk:
                log.append(str(chunk["error"]))
                raise StepFailed("".join(log))
    except StepFailed:
        raise
    except (APIError, DockerException) as e:
        raise InfraError(f"docker build {tag}: {e}") from e
    except Exception as e:  # the HTTP read timed out: the build ran past its budget
        if "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower():
            raise StepFailed("".join(log) + f"\nbuild ran past {timeout_s:.0f}s", timed_out=True) from None
        raise InfraError(f"docker build {tag}: {e}") from e
    finally:
        api.close()
    return str(client.images.get(tag).id)


def dependency_image(client: Any, plan: Plan, checkout: Path, bases: BaseImages, timeout_s: float,
                     fresh: bool = False) -> tuple[str, bool]:
    """The dependency image for ``plan`` (built unless one with the same key exists, or ``fresh``); returns
    (tag, cached)."""
    toolchain_id = client.images.get(bases.toolchain).id  # the tag moves when the toolchain image is rebuilt
    key = hashlib.sha256(json.dumps([RULES_VERSION, plan.system, toolchain_id, plan.deps_script, plan.env,
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
        dockerfile = (f"FROM {bases.toolchain}\n{_env_lines(plan.env)}WORKDIR /work\nCOPY manifests/ /work/\n"
                      f"{_run(plan.deps_script)}")
        build(client, ctx, dockerfile, tag, timeout_s, {"kiln.role": "dependencies", "kiln.system": plan.system},
              nocache=fresh)
    return tag, False


def project_image(client: Any, plan: Plan, checkout: Path, base_tag: str, tag: str, labels: dict[str, str],
                  timeout_s: float, fresh: bool = False) -> str:
    """Sources and the build on top of the dependency image; the work tree is handed to the test user."""
    with tempfile.TemporaryDirectory(prefix="kiln-src-") as tmp:
        ctx = Path(tmp)
        shutil.copytree(checkout, ctx / "src", symlinks=True)
        dockerfile = (f"FROM {base_tag}\n{_env_lines(plan.env)}WORKDIR /work\nCOPY --chown=1000:1000 src/ /work/\n"
                      f"{_run(plan.build_script + ' && ' + HAND_OVER)}")
        return build(client, ctx, dockerfile, tag, timeout_s, labels, nocache=fresh)


def dockerfile_image(client: Any, plan: Plan, checkout: Path, bases: BaseImages, tag: str, labels: dict[str, str],
                     timeout_s: float, fresh: bool = False) -> str:
    assert plan.dockerfile is not None
    text = plan.dockerfile.replace(LOCAL_IMAGE_MARK + "toolchain", bases.toolchain).replace(
        LOCAL_IMAGE_MARK + "base", bases.base)
    with tempfile.TemporaryDirectory(prefix="kiln-df-") as tmp:
        ctx = Path(tmp) / "ctx"
        shutil.copytree(checkout, ctx, symlinks=True)
        return build(client, ctx, text, tag, timeout_s, labels, nocache=fresh)


def test_command(plan: Plan) -> str:
    where = "" if plan.recipe == "dockerfile" else "cd /work && "
    return f"mkdir -p /tmp/kiln-reports && {where}{plan.test_script}"
