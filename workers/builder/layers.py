"""Revisions as image layers: a repository's first built revision is its base image; each later revision is ONE
layer on the previous revision's image, holding the changed files, whiteouts for deleted ones and, when needed, the
delta a rebuild produced (dependency manifests changed, or a compiled build system). A commit touching only files
that cannot affect build or tests maps to the previous image. Chains are re-based every ``max_depth`` layers.

kiln assembles these images itself through the registry API: the new layer blob, a config with one more diff id,
a manifest with one more layer. Any revision's image is then pulled by digest like any other.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gzip
import io
import json
import tarfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from docker.errors import APIError, DockerException

from kiln.ingest.reader import Repository, TreeEntry
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import BlobNotFound, InfraError
from kiln.workers.builder.errors import StepFailed
from kiln.workers.builder.images import repository_slug
from kiln.workers.builder.sandbox import UNPRIVILEGED, BuildSandbox
from kiln.workers.common import sandbox as policy
from kiln.workers.common.containers import exec_capped, kill_on_cancel, read_capped
from kiln.workers.common.registry import CONFIG_V1, LAYER_GZIP, Registry, sha256_digest

# Files that cannot change a build or its tests (overridable per call).
INERT = ("*.md", "*.rst", "docs/*", "doc/*", ".github/*", ".gitlab-ci.yml", ".travis.yml", "LICENSE*", "COPYING*",
         "CHANGELOG*", "AUTHORS*", ".gitignore", ".gitattributes", ".editorconfig")
NAMESPACE = "revisions"


@dataclass
class RevisionImage:
    commit: str
    reference: str  # registry/name@sha256:... (pullable)
    parent: str | None
    depth: int
    kind: Literal["base", "layer", "same"]
    layer_bytes: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


def record_name(repository: str, commit: str) -> str:
    return f"{NAMESPACE}/{repository}/{commit}"


def lookup(blobs: BlobStore, repository: str, commit: str) -> RevisionImage | None:
    """The image of (repository, commit), if one was built."""
    try:
        return RevisionImage(**json.loads(blobs.get_name(record_name(repository, commit))))
    except BlobNotFound:
        return None


def remember(blobs: BlobStore, repository: str, image: RevisionImage) -> None:
    blobs.set_name(record_name(repository, image.commit), image.to_json())


@dataclass
class Diff:
    changed: dict[bytes, TreeEntry]
    deleted: list[bytes]

    def paths(self) -> list[str]:
        return [p.decode(errors="replace") for p in [*self.changed, *self.deleted]]


def diff(repo: Repository, parent: str, commit: str) -> Diff:
    before = {e.path: e for e in repo.walk(parent)}
    after = {e.path: e for e in repo.walk(commit)}
    changed = {p: e for p, e in after.items() if p not in before or (before[p].oid, before[p].mode) != (e.oid, e.mode)}
    return Diff(changed, sorted(p for p in before if p not in after))


def inert(d: Diff, patterns: tuple[str, ...] = INERT) -> bool:
    return bool(d.paths()) and all(any(fnmatch.fnmatch(p, pat) for pat in patterns) for p in d.paths())


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", mode: int = 0o644, kind: bytes = tarfile.REGTYPE,
         link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, 1000, 1000, 0
    info.uname = info.gname = "kiln"
    if kind == tarfile.SYMTYPE:
        info.linkname = link
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def source_layer(repo: Repository, d: Diff, root: str = "work") -> bytes:
    """A layer tar: changed files under ``/work`` (uid 1000, git modes, symlinks) and ``.wh.`` whiteouts."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(d.deleted):
            parent, _, name = path.decode(errors="surrogateescape").rpartition("/")
            _add(tar, f"{root}/{parent + '/' if parent else ''}.wh.{name}")
        dirs: set[str] = set()
        for path, entry in sorted(d.changed.items()):
            text = path.decode(errors="surrogateescape")
            parts = text.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                directory = "/".join(parts[:i])
                if directory not in dirs:
                    dirs.add(directory)
                    _add(tar, f"{root}/{directory}", mode=0o755, kind=tarfile.DIRTYPE)
            if entry.kind == "symlink":
                _add(tar, f"{root}/{text}", kind=tarfile.SYMTYPE, link=repo.blob(entry.oid).decode())
            elif entry.kind == "submodule":
                _add(tar, f"{root}/{text}", mode=0o755, kind=tarfile.DIRTYPE)
            else:
                _add(tar, f"{root}/{text}", repo.blob(entry.oid), 0o755 if entry.kind == "executable" else 0o644)
    return buffer.getvalue()


def merge_layers(layers: list[bytes]) -> bytes:
    """Several layer tars (bottom first) as one, keeping the whiteouts that hide what lies below them."""
    entries: dict[str, tuple[tarfile.TarInfo, bytes]] = {}
    for layer in layers:
        with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
            for info in tar.getmembers():
                name = info.name.rstrip("/").removeprefix("./")
                directory, _, base = name.rpartition("/")
                prefix = f"{directory}/" if directory else ""
                if base == ".wh..wh..opq":
                    for key in [k for k in entries if k.startswith(prefix) and k != directory]:
                        del entries[key]
                elif base.startswith(".wh."):
                    hidden = prefix + base[len(".wh."):]
                    for key in [k for k in entries if k == hidden or k.startswith(hidden + "/")]:
                        del entries[key]
                else:
                    entries.pop(f"{prefix}.wh.{base}", None)
                extracted = tar.extractfile(info) if info.isfile() else None
                info.name = name
                entries[name] = (info, extracted.read() if extracted else b"")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as out:
        for info, data in entries.values():
            out.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buffer.getvalue()


def stack_layer(registry: Registry, name: str, parent_ref: str, layer: bytes, tag: str,
                labels: dict[str, str]) -> tuple[str, int]:
    """Push ``layer`` as one more layer on the parent image; returns (pullable reference, compressed bytes)."""
    parent_manifest, _ = registry.manifest(name, parent_ref.rsplit("@", 1)[-1])
    config = json.loads(registry.blob(name, parent_manifest["config"]["digest"]))
    packed = gzip.compress(layer, compresslevel=6, mtime=0)
    layer_digest = registry.put_blob(name, packed)
    config["rootfs"]["diff_ids"].append(sha256_digest(layer))
    config.setdefault("history", []).append({"created": datetime.now(UTC).isoformat(), "created_by": "kiln revision"
                                             f" layer {tag}"})
    config.setdefault("config", {}).setdefault("Labels", {}).update(labels)
    config_bytes = json.dumps(config).encode()
    config_digest = registry.put_blob(name, config_bytes)
    manifest = {**parent_manifest,
                "config": {"mediaType": CONFIG_V1, "size": len(config_bytes), "digest": config_digest},
                "layers": [*parent_manifest["layers"], {"mediaType": LAYER_GZIP, "size": len(packed),
                                                        "digest": layer_digest}]}
    digest = registry.put_manifest(name, tag, manifest)
    return f"{registry.address}/{name}@{digest}", len(packed)


def rebuild_layer(client: Any, parent_image: str, repo: Repository, d: Diff, script: str,
                  env: dict[str, str], timeout_s: float) -> bytes:
    """Changed files + a rebuild (``script``, as the unprivileged user, in the build sandbox) in a container of the
    parent image; what the container changed (``docker diff``) becomes the layer: added trees and files, whiteouts
    for deletions."""
    sandbox = BuildSandbox()
    try:
        container = policy.create(client, parent_image, ["sleep", "infinity"], profile=policy.BUILD_STEP,
                                  limits=sandbox.limits(), egress=sandbox.network, working_dir="/work",
                                  environment={**env, **sandbox.proxy_env()}, cgroup_parent=sandbox.worker_cgroup())
    except (APIError, DockerException) as e:
        raise InfraError(f"creating the rebuild container from {parent_image}: {e}") from e
    kill_on_cancel(container)
    try:
        container.start()
        container.put_archive("/", source_layer(repo, Diff(d.changed, []), "work"))
        removals = ["rm", "-rf", "--", *(f"/work/{p.decode(errors='replace')}" for p in d.deleted)]
        # The SDK's exec has no time limit: the command carries its own (KILL, so nothing can ignore it).
        rebuild = ["timeout", "-s", "KILL", str(max(1, int(timeout_s))), "bash", "-c", script]
        for command in ([removals] if d.deleted else []) + [rebuild]:
            code, output = exec_capped(container, command, sandbox.log_bytes, user=UNPRIVILEGED, workdir="/work")
            if code == 137:
                raise StepFailed(f"revision rebuild ran past {timeout_s:.0f}s", timed_out=True)
            if code != 0:
                raise StepFailed(f"revision rebuild failed: {output}")
        changes = sorted(container.diff() or [], key=lambda c: c["Path"])
        return _layer_from_changes(container, changes, sandbox.layer_bytes)
    except (APIError, DockerException) as e:
        raise InfraError(f"revision rebuild in {parent_image}: {e}") from e
    finally:
        with contextlib.suppress(APIError, DockerException):
            container.remove(force=True)


def _layer_from_changes(container: Any, changes: list[dict[str, Any]], cap: int) -> bytes:
    """The layer tar of ``changes``; StepFailed once what the rebuild wrote passes ``cap`` bytes (read as streams:
    the worker never holds more than that)."""
    # A changed directory is listed with its changed children: never download it whole (it may be /opt).
    parents = {str(c["Path"]).rpartition("/")[0] for c in changes}
    added_dirs: list[str] = []
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as out:
        for change in changes:
            path, kind = str(change["Path"]), int(change["Kind"])
            if path.startswith(("/tmp", "/proc", "/sys", "/dev", "/run")) or any(
                    path.startswith(d + "/") for d in added_dirs):
                continue
            parent, _, base = path.rpartition("/")
            if kind == 2:
                _add(out, f"{parent.lstrip('/')}/.wh.{base}".lstrip("/"))
                continue
            if kind == 0 and path in parents:
                continue
            try:
                stream, _stat = container.get_archive(path)
            except Exception:  # vanished between diff and read (e.g. a socket): nothing to carry
                continue
            if path in parents:
                added_dirs.append(path)  # a new directory comes whole, children included
            archive = read_capped(stream, cap - buffer.tell())
            if archive is None:
                raise StepFailed(f"revision rebuild wrote more than {cap} bytes (KILN_BUILD_LAYER_BYTES)")
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                for info in tar.getmembers():
                    data = tar.extractfile(info) if info.isfile() else None
                    info.name = f"{parent.lstrip('/')}/{info.name}".lstrip("/")
                    out.addfile(info, data)
    return buffer.getvalue()


def registry_name(repository: str) -> str:
    return "kiln/rev/" + repository_slug(repository, 120)
