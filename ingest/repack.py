"""Turn a fetched bare repository into the stored form: one deterministic pack, its index and the manifest.

``git pack-objects`` is deterministic when it runs single-threaded, recomputes every delta and recompresses every
object (``--no-reuse-delta --no-reuse-object``) and sees the same tips in the same order: the result then depends
only on the objects, not on how the fetch happened to pack them. (Across git or zlib versions it can differ;
the store records digests, so a rebuild on another version still serves the same content.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from kiln.ingest.download import Git, local_refs
from kiln.ingest.errors import CorruptPack
from kiln.ingest.gitpack import PackFile
from kiln.ingest.manifest import Manifest
from kiln.ingest.objects import Commit, TreeItem, parse_commit, parse_tag_target, parse_tree

PACK_CONFIG = ["-c", "pack.useBitmaps=false", "-c", "pack.writeBitmapIndex=false", "-c", "core.compression=6",
               "-c", "pack.compression=6", "-c", "pack.useSparse=false"]


@dataclass
class Repacked:
    pack: Path
    idx: Path
    refs: dict[str, str]  # name -> object id as stored (annotated tags: the tag object)
    manifest: Manifest  # pack/idx digests are filled in by the store when it uploads them


async def repack(git: Git, out_dir: Path, head_hint: str | None) -> Repacked:
    refs = await local_refs(git)
    if not refs:
        raise CorruptPack("nothing to pack: the repository has no refs")
    tips = "".join(sorted({oid + "\n" for oid in refs.values()})).encode()
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    name = (await git.run(*PACK_CONFIG, "pack-objects", "--revs", "--threads=1", "--no-reuse-delta",
                          "--no-reuse-object", "--window=10", "--depth=50", "--quiet", str(out_dir / "kiln"),
                          stdin=tips)).decode().strip()
    pack, idx = out_dir / f"kiln-{name}.pack", out_dir / f"kiln-{name}.idx"
    manifest = build_manifest(pack, idx, refs, head_hint)
    return Repacked(pack, idx, refs, manifest)


def build_manifest(pack_path: Path, idx_path: Path, refs: dict[str, str], head_hint: str | None) -> Manifest:
    pack = PackFile(pack_path, idx_path)
    try:
        commits: dict[str, Commit] = {}
        trees: dict[str, list[TreeItem]] = {}
        tag_targets: dict[str, tuple[str, str]] = {}
        ids = pack.index.ids()
        for oid in ids:
            kind = pack.type_of(oid)
            if kind == "commit":
                commits[oid.hex()] = parse_commit(pack.read(oid).data)
            elif kind == "tree":
                trees[oid.hex()] = parse_tree(pack.read(oid).data)
            elif kind == "tag":
                tag_targets[oid.hex()] = parse_tag_target(pack.read(oid).data)
        peeled: dict[str, str] = {}
        tags: dict[str, str] = {}
        for ref, stored in sorted(refs.items()):
            target, seen = stored, 0
            while target in tag_targets and seen < 16:
                tags.setdefault(ref, stored)
                target, seen = tag_targets[target][0], seen + 1
            if target in commits:  # refs to bare trees or blobs are not revisions: leave them out
                peeled[ref] = target
        head = head_hint if head_hint in peeled else next(
            (r for r in ("refs/heads/main", "refs/heads/master") if r in peeled),
            next((r for r in sorted(peeled) if r.startswith("refs/heads/")), None))
        return Manifest(pack="", idx="", pack_bytes=pack_path.stat().st_size, objects=len(ids), head=head,
                        refs=peeled, tags={k: v for k, v in tags.items() if k in peeled}, commits=commits,
                        trees=trees)
    finally:
        pack.close()
