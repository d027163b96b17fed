"""Build a repository's revisions as a chain of images in the registry: base image, then one layer per revision."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.ingest.errors import SaucerError
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.images import ImageContract
from kiln.streams.cancel import in_thread
from kiln.streams.errors import InfraError
from kiln.workers.builder import layers
from kiln.workers.builder.errors import PlanError, StepFailed
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.rules import RULES_VERSION, plan
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.builder.service import build_revision, revision_version
from kiln.workers.common import reports
from kiln.workers.common.containers import Limits, run_sandboxed
from kiln.workers.common.registry import Registry


async def push(client: Any, registry: Registry, local: str, name: str, tag: str) -> str:
    """Push a local image; returns its pullable ``registry/name@digest`` reference."""
    target = f"{registry.address}/{name}"
    await in_thread(client.images.get(local).tag, target, tag)
    for line in await in_thread(lambda: list(client.images.push(target, tag=tag, stream=True, decode=True,
                                                                             auth_config=registry.docker_auth()))):
        if "error" in line:
            raise InfraError(f"push {target}:{tag}: {line['error']}")
    _, digest = await in_thread(registry.manifest, name, tag)
    return f"{target}@{digest}"


async def image_for(repository: str, commit: str, store: SaucerStore, client: Any, registry: Registry,
                    bases: BaseImages, work_root: Path, limits: Limits, max_depth: int = 10,
                    inert: tuple[str, ...] = layers.INERT) -> layers.RevisionImage:
    """The image of (repository, commit): recorded, same as its parent's, one layer on it, or a new base."""
    known = layers.lookup(store.blobs, repository, commit)
    if known is not None:
        return known
    repo = store.repository(repository)
    parents = repo.commit(commit).parents
    parent = layers.lookup(store.blobs, repository, parents[0]) if parents else None
    name = layers.registry_name(repository)
    if parent is None or parent.depth >= max_depth:
        event = await build_revision(BuildRequest(repository=repository, revision=commit), store, client, bases,
                                     work_root, limits)
        if not event.usable or event.image is None:
            raise InfraError(f"base build of {repository}@{commit[:12]} failed: {event.failure}: {event.detail}")
        ref = await push(client, registry, event.image, name, commit[:12])
        image = layers.RevisionImage(commit, ref, parent.commit if parent else None, 0, "base")
    else:
        d = await in_thread(layers.diff, repo, parent.commit, commit)
        if not d.paths() or layers.inert(d, inert):
            image = layers.RevisionImage(commit, parent.reference, parent.commit, parent.depth, "same")
        else:
            with tempfile.TemporaryDirectory(dir=work_root) as tmp:
                await in_thread(repo.checkout, commit, Path(tmp))
                the_plan = plan(Path(tmp), revision_version(repo, commit))
            deps_changed = any(p in the_plan.manifests for p in d.paths())
            if deps_changed or the_plan.system != "python":
                script = " && ".join(s for s in (the_plan.deps_script if deps_changed else "",
                                                 the_plan.build_script) if s)
                await in_thread(client.images.pull, parent.reference, auth_config=registry.docker_auth())
                layer = await in_thread(layers.rebuild_layer, client, parent.reference, repo, d, script,
                                                the_plan.env, limits.timeout_s)
            else:
                layer = await in_thread(layers.source_layer, repo, d)
            ref, size = await in_thread(layers.stack_layer, registry, name, parent.reference, layer,
                                                commit[:12], {"kiln.commit": commit})
            image = layers.RevisionImage(commit, ref, parent.commit, parent.depth + 1, "layer", size)
    layers.remember(store.blobs, repository, image)
    return image


async def build_layered(request: BuildRequest, store: SaucerStore, client: Any, bases: BaseImages,
                        registry: Registry, work_root: Path, limits: Limits) -> BuildEvent:
    """A layered build (see ``revisions.image_for``), then the revision's tests in its image."""
    started = time.monotonic()
    event = BuildEvent(repository=request.repository, revision=request.revision, rules_version=RULES_VERSION,
                       status="failed")
    try:
        repo = store.repository(request.repository)
        commit = repo.resolve(request.revision)
        image = await image_for(request.repository, commit, store, client, registry, bases, work_root, limits)
    except (SaucerError, InfraError) as e:
        return event.model_copy(update={"failure": "infrastructure", "detail": str(e)[-4000:]})
    except PlanError as e:
        return event.model_copy(update={"failure": e.failure, "detail": str(e)})
    except StepFailed as e:
        return event.model_copy(update={"failure": "timeout" if e.timed_out else "compile_failed",
                                        "detail": e.log[-4000:]})
    await in_thread(client.images.pull, image.reference, auth_config=registry.docker_auth())
    try:
        contract = ImageContract.from_labels(client.images.get(image.reference).labels)
    except ValidationError as e:
        return event.model_copy(update={"failure": "infrastructure", "detail": f"{image.reference}: {e}"[-4000:]})
    event = event.model_copy(update={
        "commit": commit, "status": "built", "recipe": "rules", "system": contract.system or None,
        "image": image.reference, "revision_image": image.kind, "parent_commit": image.parent})
    if request.run_tests and contract.test:
        run = await in_thread(run_sandboxed, client, image.reference, contract.test, role="build-test",
                              collect=contract.reports_dir, limits=limits, env=contract.env,
                              cgroup_parent=BuildSandbox().worker_cgroup())
        tests = reports.parse_results(contract.system, run.exit_code, run.files, contract.module)
        problem = reports.unusable_reason(tests) if tests else ("tests_did_not_run", "no test results")
        if problem is not None:
            return event.model_copy(update={"failure": problem[0], "tests": tests,
                                            "detail": f"{problem[1]}:\n{run.output}"[-4000:]})
        event = event.model_copy(update={"usable": True, "tests": tests})
    return event.model_copy(update={"durations_s": {"total": round(time.monotonic() - started, 3)}})
