"""Storage and build time of 20 revisions: kiln's one-layer-per-revision chain vs conventional builds.

The repository: the Python calc project plus --files generated source modules (sources dominate what a revision
changes), then 19 revisions editing one or two modules each, one adding a dependency and one touching only
documentation. Both ways push every revision to the registry (on S3):
- ours: ``kiln.workers.builder.revisions.image_for`` (base image, then one thin layer per revision, docs-only:
  none);
- conventional: what a Dockerfile pipeline does for the same work: per revision ``FROM`` the dependency image
  (Docker's cache reuses it until a manifest changes), ``COPY`` the whole source tree, and run the same build step
  ours runs for that revision (for Python sources none: the project is installed editable; on a dependency change
  the dependency install), then push under another name.
Bytes are the registry's after its own de-duplication: the sum of the distinct blobs (layers + configs) the
revisions' manifests reference, without the blobs both ways reference (toolchain and dependency layers).
Prints ``layer_bytes``, ``conventional_bytes``, ``layer_storage_ratio`` (aim <= 0.3) and
``revision_build_s_p50`` for both.
Usage: python -m bench.layers [--files 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import report
from kiln.ingest.reader import Repository
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.infra import COMPONENT_STEPS, run_script, run_steps
from kiln.workers.builder import images, layers
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.revisions import image_for, push
from kiln.workers.builder.rules import plan
from kiln.workers.common.containers import Limits, docker_client
from kiln.workers.common.registry import Registry
from tests.ingest.gitrepos import write
from tests.workers.builder.projects import python_project


def module(i: int, version: int, rng: random.Random) -> str:
    body = "".join(f"def f{i}_{k}(x):\n    return x * {k} + {version}  # {rng.random():.12f}\n\n\n"
                   for k in range(40))
    return f'"""Module {i}, version {version}."""\n\n\n{body}'


def make_repository(root: Path, files: int) -> list[str]:
    rng = random.Random(3)
    b = python_project(root)
    for i in range(files):
        write(root, f"calc/gen/m{i}.py", module(i, 0, rng))
    write(root, "calc/gen/__init__.py", "")
    commits = [b.commit("generated sources")]
    for r in range(1, 20):
        if r == 7:
            write(root, "README.md", f"# calc\nrevision {r}\n")
        elif r == 12:
            text = (root / "pyproject.toml").read_text()
            write(root, "pyproject.toml", text.replace('requires-python = ">=3.9"',
                                                       'requires-python = ">=3.9"\ndependencies = ["six"]'))
        else:
            for i in rng.sample(range(files), 2):
                write(root, f"calc/gen/m{i}.py", module(i, r, rng))
        commits.append(b.commit(f"revision {r}"))
    return commits


def conventional_image(client: Any, repo: Repository, commit: str, bases: BaseImages, work: Path,
                       limits: Limits) -> str:
    """The revision built the Dockerfile way, doing the work ``image_for`` does for a layer: the dependency image
    (rebuilt when a manifest changed), all sources copied, the build step only where ours runs one."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        checkout = Path(tmp) / "src"
        repo.checkout(commit, checkout)
        the_plan = plan(checkout)
        if the_plan.system == "python":
            the_plan.build_script = "true"  # editable install: new sources need no step (as in image_for)
        deps, _ = images.dependency_image(client, the_plan, checkout, bases, limits.timeout_s)
        return images.project_image(client, the_plan, checkout, deps, f"kiln/conv:{commit[:12]}", {},
                                    limits.timeout_s)


def distinct_bytes(registry: Registry, name: str, references: list[str], shared: set[str]) -> int:
    blobs: dict[str, int] = {}
    for ref in references:
        manifest, _ = registry.manifest(name, ref.rsplit("@", 1)[-1] if "@" in ref else ref)
        blobs[manifest["config"]["digest"]] = manifest["config"]["size"]
        for layer in manifest["layers"]:
            if layer["digest"] not in shared:
                blobs[layer["digest"]] = layer["size"]
    return sum(blobs.values())


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=300)
    args = parser.parse_args()
    for component in ("docker", "s3", "registry"):
        run_steps(COMPONENT_STEPS[component])
    client: Any = docker_client()
    env = dict(line.split("=", 1) for line in run_script("registry/registry.sh", "env").split())
    registry = Registry(env["KILN_BUILD_REGISTRY"], env["KILN_BUILD_REGISTRY_USER"],
                        env["KILN_BUILD_REGISTRY_PASSWORD"])
    bases = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
    limits = Limits(memory_bytes=1 << 30, timeout_s=600)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        repository = f"bench/layers-{int(time.time())}"
        commits = make_repository(root / "src", args.files)
        store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
        await ingest(IngestRequest(name=repository, location=str(root / "src")), "r", store, root / "w")
        ours, ours_s = [], []
        for commit in commits:
            started = time.monotonic()
            image = await image_for(repository, commit, store, client, registry, bases, root / "w", limits)
            ours_s.append(time.monotonic() - started)
            ours.append(image.reference)
        conventional, conventional_s = [], []
        conv_name = "kiln/conv/" + layers.registry_name(repository).rsplit("/", 1)[-1]
        for commit in commits:
            started = time.monotonic()
            image = await asyncio.to_thread(conventional_image, client, store.repository(repository), commit, bases,
                                            root / "w", limits)
            conventional.append(await push(client, registry, image, conv_name, commit[:12]))
            conventional_s.append(time.monotonic() - started)
    # Blobs both reference (toolchain, dependency images before and after the dependency change) are stored once
    # in the registry either way: compare what the revisions add on top of them.
    def referenced(name: str, refs: list[str]) -> set[str]:
        return {x["digest"] for ref in refs for x in registry.manifest(name, ref.rsplit("@", 1)[-1])[0]["layers"]}

    shared = referenced(layers.registry_name(repository), ours) & referenced(conv_name, conventional)
    ours_bytes = distinct_bytes(registry, layers.registry_name(repository), ours, shared)
    conventional_bytes = distinct_bytes(registry, conv_name, conventional, shared)
    report("revisions as layers vs conventional builds (20 revisions)", {
        "layer_bytes": ours_bytes,
        "conventional_bytes": conventional_bytes,
        "layer_storage_ratio": round(ours_bytes / conventional_bytes, 4),
        "revision_build_s_p50": round(statistics.median(ours_s[1:]), 3),
        "revision_build_s_p50_conventional": round(statistics.median(conventional_s[1:]), 3),
    }, {"repository": f"calc + {args.files} generated modules; 19 revisions (1 dependency, 1 docs-only)"})


if __name__ == "__main__":
    asyncio.run(main())
