"""Git object bodies: parse commits, trees and tags; serialise trees and commits; write loose objects."""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from kiln.ingest.errors import CorruptPack

TREE_MODE = b"40000"
SUBMODULE_MODE = b"160000"
SYMLINK_MODE = b"120000"


@dataclass(frozen=True)
class TreeItem:
    mode: bytes
    name: bytes
    oid: bytes  # 20 raw bytes


@dataclass(frozen=True)
class Commit:
    tree: str
    parents: tuple[str, ...]
    time: int
    subject: str


def parse_tree(body: bytes) -> list[TreeItem]:
    items: list[TreeItem] = []
    pos, end = 0, len(body)
    while pos < end:
        space = body.find(b" ", pos)
        nul = body.find(b"\0", space)
        if space < 0 or nul < 0 or nul + 21 > end:
            raise CorruptPack("truncated tree entry")
        items.append(TreeItem(body[pos:space], body[space + 1:nul], body[nul + 1:nul + 21]))
        pos = nul + 21
    return items


def serialize_tree(items: list[TreeItem]) -> bytes:
    return b"".join(item.mode + b" " + item.name + b"\0" + item.oid for item in items)


def _headers(body: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
    head, _, message = body.partition(b"\n\n")
    fields: list[tuple[bytes, bytes]] = []
    for line in head.split(b"\n"):
        if line.startswith(b" ") and fields:  # continuation (e.g. gpgsig)
            fields[-1] = (fields[-1][0], fields[-1][1] + b"\n" + line[1:])
        else:
            key, _, value = line.partition(b" ")
            fields.append((key, value))
    return fields, message


def parse_commit(body: bytes) -> Commit:
    fields, message = _headers(body)
    tree = next((v.decode() for k, v in fields if k == b"tree"), None)
    if tree is None:
        raise CorruptPack("commit without a tree")
    parents = tuple(v.decode() for k, v in fields if k == b"parent")
    committer = next((v for k, v in fields if k == b"committer"), b"")
    try:
        when = int(committer.rsplit(b" ", 2)[-2])
    except (IndexError, ValueError):
        when = 0
    subject = message.split(b"\n", 1)[0].decode(errors="replace")[:200]
    return Commit(tree, parents, when, subject)


def rewrite_commit(body: bytes, tree: str, parents: list[str]) -> bytes:
    """The same commit (author, committer, message) on another tree and parents; signatures are dropped, since
    they would no longer verify."""
    fields, message = _headers(body)
    out = [b"tree " + tree.encode()] + [b"parent " + p.encode() for p in parents]
    for key, value in fields:
        if key not in (b"tree", b"parent", b"gpgsig", b"gpgsig-sha256", b"mergetag"):
            out.append(key + b" " + value.replace(b"\n", b"\n "))
    return b"\n".join(out) + b"\n\n" + message


def parse_tag_target(body: bytes) -> tuple[str, str]:
    fields, _ = _headers(body)
    values = dict(fields)
    return values.get(b"object", b"").decode(), values.get(b"type", b"").decode()


def object_id(kind: str, body: bytes) -> str:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).hexdigest()


def write_loose(repo: Path, kind: str, body: bytes) -> str:
    """Store one object in a bare repository's loose object directory; returns its id."""
    raw = f"{kind} {len(body)}\0".encode() + body
    oid = hashlib.sha1(raw).hexdigest()
    path = repo / "objects" / oid[:2] / oid[2:]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{oid[2:]}.{os.getpid()}")
        tmp.write_bytes(zlib.compress(raw))
        os.replace(tmp, path)
    return oid
