"""The public read API of Saucer: any file at any revision of a stored repository, in process.

Paths are bytes (git paths are). A revision is a full or abbreviated commit id, a branch, a tag, a full ref name
or ``HEAD``, optionally followed by ``~N`` / ``^N`` steps. Other stages use this (or the HTTP API in
``ingest.http``) and nothing deeper.
"""

from __future__ import annotations

import bisect
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kiln.ingest.errors import InvalidReference, NotAFile, PathNotFound, RevisionNotFound
from kiln.ingest.gitpack import PackFile
from kiln.ingest.manifest import Manifest
from kiln.ingest.objects import SUBMODULE_MODE, SYMLINK_MODE, TREE_MODE, Commit, TreeItem

MAX_PATH_BYTES = 4096
MAX_REV_CHARS = 256
_HEX = re.compile(r"^[0-9a-f]{4,40}$")
_STEPS = re.compile(r"(~\d*|\^\d*)+$")
_BAD_REV = re.compile(r"[\x00-\x20\x7f:?*\[\\]|\.\.|@\{|//|^/|/$")

EntryKind = Literal["file", "executable", "symlink", "directory", "submodule"]


@dataclass(frozen=True)
class TreeEntry:
    path: bytes
    mode: str
    oid: str
    kind: EntryKind

    @property
    def name(self) -> bytes:
        return self.path.rsplit(b"/", 1)[-1]


def _kind(mode: bytes) -> EntryKind:
    if mode == TREE_MODE:
        return "directory"
    if mode == SUBMODULE_MODE:
        return "submodule"
    if mode == SYMLINK_MODE:
        return "symlink"
    return "executable" if mode == b"100755" else "file"


def split_path(path: bytes) -> list[bytes]:
    """Components of a repository path; raises InvalidReference for traversal and absurd inputs."""
    if len(path) > MAX_PATH_BYTES:
        raise InvalidReference(f"path longer than {MAX_PATH_BYTES} bytes")
    if b"\0" in path:
        raise InvalidReference("path contains a NUL byte")
    stripped = path.strip(b"/")
    if not stripped:
        return []
    parts = stripped.split(b"/")
    for part in parts:
        if part in (b"", b".", b".."):
            raise InvalidReference(f"path component {part.decode(errors='replace')!r} is not allowed")
    return parts


class Repository:
    """One stored repository: its manifest in memory and its pack memory-mapped."""

    def __init__(self, name: str, manifest_digest: str, manifest: Manifest, pack: PackFile) -> None:
        self.name = name
        self.manifest_digest = manifest_digest
        self.manifest = manifest
        self._pack = pack
        self._tree_maps: dict[str, dict[bytes, TreeItem]] = {}
        self._lock = threading.Lock()
        self._sorted_commits: list[str] | None = None

    def close(self) -> None:
        self._pack.close()

    @property
    def pack_path(self) -> Path:
        return self._pack.pack_path

    @property
    def idx_path(self) -> Path:
        return self._pack.idx_path

    def raw(self, oid: str) -> bytes:
        """The body of any stored object (commit, tree, tag or blob)."""
        return self._pack.read(bytes.fromhex(oid)).data

    # --- revisions -------------------------------------------------------------------------------------------

    @property
    def head(self) -> str | None:
        return self.manifest.head

    def refs(self) -> dict[str, str]:
        return dict(self.manifest.refs)

    def branches(self) -> dict[str, str]:
        return {k.removeprefix("refs/heads/"): v for k, v in self.manifest.refs.items() if k.startswith("refs/heads/")}

    def tags(self) -> dict[str, str]:
        return {k.removeprefix("refs/tags/"): v for k, v in self.manifest.refs.items() if k.startswith("refs/tags/")}

    def commits(self) -> list[tuple[str, Commit]]:
        """Every stored commit, newest first (ties by id, so the order is stable)."""
        return sorted(self.manifest.commits.items(), key=lambda kv: (-kv[1].time, kv[0]))

    def commit(self, oid: str) -> Commit:
        try:
            return self.manifest.commits[oid]
        except KeyError:
            raise RevisionNotFound(f"{self.name}: no commit {oid}") from None

    def resolve(self, rev: str) -> str:
        """The commit id a revision names."""
        if not rev or len(rev) > MAX_REV_CHARS:
            raise InvalidReference(f"revision must be 1..{MAX_REV_CHARS} characters")
        steps = _STEPS.search(rev)
        base = rev[:steps.start()] if steps else rev
        if not base or _BAD_REV.search(base):
            raise InvalidReference(f"malformed revision {rev!r}")
        oid = self._resolve_base(base)
        for op, count in re.findall(r"([~^])(\d*)", rev[len(base):]):
            n = int(count) if count else 1
            if op == "~":
                for _ in range(n):
                    parents = self.commit(oid).parents
                    if not parents:
                        raise RevisionNotFound(f"{self.name}: {rev} goes past the root commit")
                    oid = parents[0]
            elif n:
                parents = self.commit(oid).parents
                if len(parents) < n:
                    raise RevisionNotFound(f"{self.name}: {rev}: commit {oid[:12]} has {len(parents)} parents")
                oid = parents[n - 1]
        return oid

    def _resolve_base(self, base: str) -> str:
        refs = self.manifest.refs
        if base == "HEAD":
            if self.manifest.head is None:
                raise RevisionNotFound(f"{self.name} has no HEAD branch")
            return refs[self.manifest.head]
        for candidate in (base, f"refs/heads/{base}", f"refs/tags/{base}"):
            if candidate in refs:
                return refs[candidate]
        if _HEX.match(base):
            if len(base) == 40:
                if base in self.manifest.commits:
                    return base
            else:
                found = self._by_prefix(base)
                if len(found) > 1:
                    raise InvalidReference(f"{self.name}: short id {base} is ambiguous ({len(found)} commits)")
                if found:
                    return found[0]
        raise RevisionNotFound(f"{self.name}: unknown revision {base!r}")

    def _by_prefix(self, prefix: str) -> list[str]:
        with self._lock:
            if self._sorted_commits is None:
                self._sorted_commits = sorted(self.manifest.commits)
            ids = self._sorted_commits
        i = bisect.bisect_left(ids, prefix)
        found: list[str] = []
        while i < len(ids) and ids[i].startswith(prefix) and len(found) < 2:
            found.append(ids[i])
            i += 1
        return found

    # --- trees and files -------------------------------------------------------------------------------------

    def _tree(self, oid: str) -> dict[bytes, TreeItem]:
        cached = self._tree_maps.get(oid)
        if cached is None:
            try:
                items = self.manifest.trees[oid]
            except KeyError:
                raise PathNotFound(f"{self.name}: tree {oid} is not stored") from None
            cached = {item.name: item for item in items}
            with self._lock:
                if len(self._tree_maps) > 50_000:
                    self._tree_maps.clear()
                self._tree_maps[oid] = cached
        return cached

    def entry(self, rev: str, path: bytes) -> TreeEntry:
        """What ``path`` is at ``rev`` (the root directory for an empty path)."""
        commit = self.resolve(rev)
        parts = split_path(path)
        oid, mode = self.commit(commit).tree, TREE_MODE
        for i, part in enumerate(parts):
            if mode != TREE_MODE:
                raise PathNotFound(f"{self.name}@{commit[:12]}: {b'/'.join(parts[:i]).decode(errors='replace')} "
                                   "is not a directory")
            item = self._tree(oid).get(part)
            if item is None:
                raise PathNotFound(f"{self.name}@{commit[:12]}: no {b'/'.join(parts).decode(errors='replace')!r}")
            oid, mode = item.oid.hex(), item.mode
        return TreeEntry(b"/".join(parts), mode.decode(), oid, _kind(mode))

    def tree(self, rev: str, path: bytes = b"") -> list[TreeEntry]:
        """The entries of the directory at ``path``, in git's order."""
        where = self.entry(rev, path)
        if where.kind != "directory":
            raise NotAFile(f"{path.decode(errors='replace')!r} is a {where.kind}, not a directory")
        prefix = where.path + b"/" if where.path else b""
        return [TreeEntry(prefix + item.name, item.mode.decode(), item.oid.hex(), _kind(item.mode))
                for item in self.manifest.trees[where.oid]]

    def read(self, rev: str, path: bytes) -> bytes:
        """The bytes of a file (a symlink reads as its target, as in ``git show``)."""
        entry = self.entry(rev, path)
        if entry.kind in ("directory", "submodule"):
            raise NotAFile(f"{path.decode(errors='replace')!r} is a {entry.kind}")
        return self.blob(entry.oid)

    def blob(self, oid: str) -> bytes:
        obj = self._pack.read(bytes.fromhex(oid))
        if obj.type != "blob":
            raise NotAFile(f"object {oid} is a {obj.type}")
        return obj.data

    def walk(self, rev: str, path: bytes = b"") -> Iterator[TreeEntry]:
        """Every non-directory entry under ``path`` at ``rev``, depth first in git's order."""
        for entry in self.tree(rev, path):
            if entry.kind == "directory":
                yield from self.walk(rev, entry.path)
            else:
                yield entry

    def checkout(self, rev: str, dest: Path) -> int:
        """Write the tree at ``rev`` into the empty directory ``dest`` (modes and symlinks kept, submodules as
        empty directories, as ``git checkout`` leaves them); returns the number of entries written."""
        commit = self.resolve(rev)
        count = 0
        for entry in self.walk(commit):
            target = dest / os.fsdecode(entry.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            if entry.kind == "submodule":
                target.mkdir(exist_ok=True)
            elif entry.kind == "symlink":
                os.symlink(os.fsdecode(self.blob(entry.oid)), target)
            else:
                target.write_bytes(self.blob(entry.oid))
                if entry.kind == "executable":
                    target.chmod(0o755)
            count += 1
        return count
