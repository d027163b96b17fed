"""Read objects straight out of a git packfile and its v2 index, in process: no ``git`` spawn on the read path.

A read is: binary search of the 20-byte id in the index's sorted table (narrowed by the fan-out), one seek into the
pack, zlib inflate, and — for deltified objects — the same for each base, with a small cache of recent bases since
a repository's hot files share them.
"""

from __future__ import annotations

import mmap
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kiln.ingest.errors import CorruptPack, ObjectNotFound

OBJ_COMMIT, OBJ_TREE, OBJ_BLOB, OBJ_TAG, OBJ_OFS_DELTA, OBJ_REF_DELTA = 1, 2, 3, 4, 6, 7
TYPE_NAMES = {OBJ_COMMIT: "commit", OBJ_TREE: "tree", OBJ_BLOB: "blob", OBJ_TAG: "tag"}
_IDX_MAGIC = b"\xfftOc"


@dataclass(frozen=True)
class PackObject:
    type: str
    data: bytes


class PackIndex:
    """A v2 ``.idx``: sorted object ids, CRCs, 31-bit offsets with a 64-bit overflow table."""

    def __init__(self, data: bytes | mmap.mmap) -> None:
        if data[:4] != _IDX_MAGIC or struct.unpack(">I", data[4:8])[0] != 2:
            raise CorruptPack("not a version 2 pack index")
        self._data = data
        self._fanout = struct.unpack(">256I", data[8:8 + 1024])
        self.count = self._fanout[255]
        self._ids = 8 + 1024
        self._offsets = self._ids + 24 * self.count  # 20-byte ids, then 4-byte CRCs
        self._large = self._offsets + 4 * self.count

    def offset(self, oid: bytes) -> int:
        lo = self._fanout[oid[0] - 1] if oid[0] else 0
        hi = self._fanout[oid[0]]
        data, base = self._data, self._ids
        while lo < hi:
            mid = (lo + hi) // 2
            here = data[base + 20 * mid: base + 20 * mid + 20]
            if here < oid:
                lo = mid + 1
            elif here > oid:
                hi = mid
            else:
                (off,) = struct.unpack(">I", data[self._offsets + 4 * mid: self._offsets + 4 * mid + 4])
                if off & 0x80000000:
                    pos = self._large + 8 * (off & 0x7FFFFFFF)
                    (off,) = struct.unpack(">Q", data[pos:pos + 8])
                return int(off)
        raise ObjectNotFound(oid.hex())

    def ids(self) -> list[bytes]:
        base = self._ids
        return [bytes(self._data[base + 20 * i: base + 20 * i + 20]) for i in range(self.count)]

    def __contains__(self, oid: bytes) -> bool:
        try:
            self.offset(oid)
        except ObjectNotFound:
            return False
        return True


def _varint_size(data: bytes, pos: int) -> tuple[int, int]:
    """The little-endian base-128 size used in delta headers."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def apply_delta(base: bytes, delta: bytes) -> bytes:
    try:
        return _apply_delta(base, delta)
    except IndexError:
        raise CorruptPack("delta is truncated") from None


def _apply_delta(base: bytes, delta: bytes) -> bytes:
    src_size, pos = _varint_size(delta, 0)
    dst_size, pos = _varint_size(delta, pos)
    if src_size != len(base):
        raise CorruptPack(f"delta expects a {src_size}-byte base, got {len(base)}")
    out = bytearray()
    end = len(delta)
    while pos < end:
        op = delta[pos]
        pos += 1
        if op & 0x80:  # copy from base: offset/size bytes present per flag bit
            offset = size = 0
            for i in range(4):
                if op & (1 << i):
                    offset |= delta[pos] << (8 * i)
                    pos += 1
            for i in range(3):
                if op & (0x10 << i):
                    size |= delta[pos] << (8 * i)
                    pos += 1
            out += base[offset:offset + (size or 0x10000)]
        elif op:
            out += delta[pos:pos + op]
            pos += op
        else:
            raise CorruptPack("delta opcode 0 is reserved")
    if len(out) != dst_size:
        raise CorruptPack(f"delta produced {len(out)} bytes, expected {dst_size}")
    return bytes(out)


class PackFile:
    """A memory-mapped ``.pack`` with its index; ``read(oid)`` returns the object's type and full content."""

    def __init__(self, pack_path: Path, idx_path: Path, cache_bytes: int = 32 << 20) -> None:
        self.pack_path, self.idx_path = pack_path, idx_path
        with pack_path.open("rb") as f:
            self._pack = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with idx_path.open("rb") as f:
            self.index = PackIndex(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        if self._pack[:4] != b"PACK":
            raise CorruptPack(f"{pack_path} is not a packfile")
        self._cache: OrderedDict[int, tuple[int, bytes]] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = cache_bytes
        self._lock = threading.Lock()  # the base cache is shared by the HTTP server's threads

    def close(self) -> None:
        self._pack.close()

    def read(self, oid: bytes) -> PackObject:
        with self._lock:
            type_code, data = self._at(self.index.offset(oid))
        return PackObject(TYPE_NAMES[type_code], data)

    def type_of(self, oid: bytes) -> str:
        """The object's type from headers alone (following delta bases), without inflating anything."""
        offset = self.index.offset(oid)
        while True:
            type_code, pos, _ = self._header(offset)
            if type_code == OBJ_OFS_DELTA:
                offset -= self._ofs_base(pos)[0]
            elif type_code == OBJ_REF_DELTA:
                offset = self.index.offset(bytes(self._pack[pos:pos + 20]))
            else:
                return TYPE_NAMES[type_code]

    def _header(self, offset: int) -> tuple[int, int, int]:
        """(type, position after the header, inflated size) of the entry at ``offset``."""
        pack = self._pack
        byte = pack[offset]
        type_code = (byte >> 4) & 7
        size = byte & 0x0F
        pos, shift = offset + 1, 4
        while byte & 0x80:
            byte = pack[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
        return type_code, pos, size

    def _ofs_base(self, pos: int) -> tuple[int, int]:
        """(distance back to the base, position after the encoded distance) of an OFS_DELTA entry."""
        pack = self._pack
        byte = pack[pos]
        pos += 1
        rel = byte & 0x7F
        while byte & 0x80:
            byte = pack[pos]
            pos += 1
            rel = ((rel + 1) << 7) | (byte & 0x7F)
        return rel, pos

    def _inflate(self, pos: int, size: int) -> bytes:
        out = zlib.decompressobj().decompress(self._pack[pos:pos + size + 1024 + size // 2], size)
        if len(out) != size:
            raise CorruptPack(f"object at {pos} inflated to {len(out)} bytes, expected {size}")
        return out

    def _at(self, offset: int) -> tuple[int, bytes]:
        cached = self._cache.get(offset)
        if cached is not None:
            self._cache.move_to_end(offset)
            return cached
        type_code, pos, size = self._header(offset)
        if type_code == OBJ_OFS_DELTA:
            rel, pos = self._ofs_base(pos)
            base_type, base = self._at(offset - rel)
            result = (base_type, apply_delta(base, self._inflate(pos, size)))
        elif type_code == OBJ_REF_DELTA:
            base_type, base = self._at(self.index.offset(bytes(self._pack[pos:pos + 20])))
            result = (base_type, apply_delta(base, self._inflate(pos + 20, size)))
        elif type_code in TYPE_NAMES:
            result = (type_code, self._inflate(pos, size))
        else:
            raise CorruptPack(f"unknown object type {type_code} at offset {offset}")
        self._remember(offset, result)
        return result

    def _remember(self, offset: int, entry: tuple[int, bytes]) -> None:
        size = len(entry[1])
        if size > self._cache_limit // 8:
            return
        self._cache[offset] = entry
        self._cache_bytes += size
        while self._cache_bytes > self._cache_limit:
            _, (_, old) = self._cache.popitem(last=False)
            self._cache_bytes -= len(old)
