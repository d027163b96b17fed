"""The compact, deterministic description of a stored repository, next to its pack and index.

It holds refs -> commits, each commit's tree and parents, and every distinct tree once (keyed by id, so the trees
that commits share are stored once): resolving a path at a revision is dictionary lookups, and only the final blob
is read from the pack. Serialised as canonical JSON (sorted keys, names as latin-1 so any bytes survive), then
zstd at a fixed level: equal repositories give byte-equal manifests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import zstandard

from kiln.ingest.errors import CorruptPack
from kiln.ingest.objects import Commit, TreeItem

FORMAT = 1
ZSTD_LEVEL = 10


@dataclass
class Manifest:
    pack: str
    idx: str
    pack_bytes: int
    objects: int
    head: str | None
    refs: dict[str, str]  # name -> commit id (tags peeled)
    tags: dict[str, str]  # annotated tag name -> tag object id
    commits: dict[str, Commit]
    trees: dict[str, list[TreeItem]] = field(repr=False)

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT, "pack": self.pack, "idx": self.idx, "pack_bytes": self.pack_bytes,
            "objects": self.objects, "head": self.head, "refs": self.refs, "tags": self.tags,
            "commits": {k: [c.tree, list(c.parents), c.time, c.subject] for k, c in self.commits.items()},
            "trees": {k: [[i.mode.decode(), i.name.decode("latin-1"), i.oid.hex()] for i in items]
                      for k, items in self.trees.items()},
        }
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0).compress(text.encode())

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            doc = json.loads(zstandard.ZstdDecompressor().decompress(data))
            if doc.get("format") != FORMAT:
                raise CorruptPack(f"manifest format {doc.get('format')!r} is not {FORMAT}")
            return cls(
                pack=doc["pack"], idx=doc["idx"], pack_bytes=doc["pack_bytes"], objects=doc["objects"],
                head=doc["head"], refs=doc["refs"], tags=doc["tags"],
                commits={k: Commit(v[0], tuple(v[1]), v[2], v[3]) for k, v in doc["commits"].items()},
                trees={k: [TreeItem(m.encode(), n.encode("latin-1"), bytes.fromhex(o)) for m, n, o in items]
                       for k, items in doc["trees"].items()},
            )
        except (zstandard.ZstdError, ValueError, KeyError, IndexError, TypeError) as e:
            raise CorruptPack(f"unreadable manifest: {e}") from e
