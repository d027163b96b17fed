"""Saucer's store: artifacts in the blob store (content-addressed) and one name per repository pointing at its
manifest. Works on any ``BlobStore``; readers on other nodes download pack and index once into their cache."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.ingest.errors import RepositoryNotFound
from kiln.ingest.gitpack import PackFile
from kiln.ingest.manifest import Manifest
from kiln.ingest.reader import Repository
from kiln.ingest.repack import Repacked
from kiln.schemas.ingest import REPO_NAME
from kiln.streams.blobstore import BlobStore, open_blob_store
from kiln.streams.errors import BlobNotFound
from kiln.streams.settings import KilnSettings

NAMESPACE = "saucer/repos"
POINTER_TTL_S = 2.0


@dataclass(frozen=True)
class Published:
    manifest_digest: str
    manifest: Manifest


class SaucerStore:
    def __init__(self, blobs: BlobStore, cache_dir: Path) -> None:
        self.blobs = blobs
        self.cache_dir = cache_dir
        self._open: dict[str, Repository] = {}  # manifest digest -> opened repository
        self._pointers: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: KilnSettings) -> SaucerStore:
        return cls(open_blob_store(settings), settings.cache / "saucer")

    def publish(self, name: str, repacked: Repacked, record: dict[str, Any]) -> Published:
        """Upload pack, index and manifest, then point ``name`` at the manifest (the commit point)."""
        with repacked.pack.open("rb") as f:
            pack = self.blobs.put_stream(f)
        with repacked.idx.open("rb") as f:
            idx = self.blobs.put_stream(f)
        manifest = repacked.manifest
        manifest.pack, manifest.idx = pack.digest, idx.digest
        digest = self.blobs.put(manifest.to_bytes()).digest
        pointer = {"manifest": digest, **record}
        self.blobs.set_name(f"{NAMESPACE}/{name}", json.dumps(pointer, sort_keys=True).encode())
        with self._lock:
            self._pointers.pop(name, None)
        return Published(digest, manifest)

    def names(self) -> list[str]:
        return self.blobs.list_names(NAMESPACE)

    def pointer(self, name: str) -> dict[str, Any]:
        """The repository's current manifest digest and ingestion record (re-read every couple of seconds)."""
        if not re.match(REPO_NAME, name) or len(name) > 200:
            raise RepositoryNotFound(f"no repository {name!r}")
        now = time.monotonic()
        with self._lock:
            cached = self._pointers.get(name)
        if cached is not None and now - cached[0] < POINTER_TTL_S:
            return cached[1]
        try:
            pointer: dict[str, Any] = json.loads(self.blobs.get_name(f"{NAMESPACE}/{name}"))
        except BlobNotFound:
            raise RepositoryNotFound(f"no repository {name!r}") from None
        with self._lock:
            self._pointers[name] = (now, pointer)
        return pointer

    def opened(self, name: str) -> Repository | None:
        """The repository if reading it needs no I/O now (its pointer is fresh and its pack open), else None."""
        with self._lock:
            cached = self._pointers.get(name)
            if cached is None or time.monotonic() - cached[0] >= POINTER_TTL_S:
                return None
            return self._open.get(str(cached[1]["manifest"]))

    def repository(self, name: str) -> Repository:
        digest = str(self.pointer(name)["manifest"])
        with self._lock:
            repo = self._open.get(digest)
        if repo is not None:
            return repo
        manifest = Manifest.from_bytes(self.blobs.get(digest))
        blobs_dir = self.cache_dir / "blobs"
        pack = PackFile(self.blobs.local_copy(manifest.pack, blobs_dir), self.blobs.local_copy(manifest.idx, blobs_dir))
        repo = Repository(name, digest, manifest, pack)
        with self._lock:
            self._open.setdefault(digest, repo)
            return self._open[digest]
