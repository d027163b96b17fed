"""Per-partition offset tracking for out-of-order completion, its compact commit-metadata encoding, and the
consumer-side helpers that feed it.

The committed offset of a partition is its lowest unfinished offset. Jobs finished *beyond* it are remembered in
the commit's metadata string (run-length encoded, zlib-compressed, base64; bounded well under the broker's
4 KiB limit), so after a crash or rebalance the new owner skips them and only the jobs really in flight run
again. A map that outgrows the metadata is spilled: stored in the blob store, and the metadata names its digest
(``k2:<sha256>``). Without a blob store the runtime stops taking the partition's jobs before the map would outgrow
the metadata (``map_full``); only as a last resort are the farthest runs dropped (a re-run, never a lost job).
"""

from __future__ import annotations

import base64
import bisect
import zlib
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, Message, TopicPartition

from kiln.streams.errors import OffsetMapError

METADATA_PREFIX = "k1:"
SPILL_PREFIX = "k2:"
"""Metadata naming a spilled map: the blob (digest after the prefix) holds the ``k1:`` text of the whole map."""
MAX_METADATA_CHARS = 3000
MAP_SOFT_LIMIT_CHARS = 2000
"""Past this the runtime stops taking a partition's jobs until its finished-ahead map shrinks."""
MAP_RUNS_CHECKED = 150


def _varint(n: int, out: bytearray) -> None:
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _read_varints(data: bytes) -> list[int]:
    values, cur, shift = [], 0, 0
    for byte in data:
        cur |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 63:
                raise OffsetMapError("varint too long")
        else:
            values.append(cur)
            cur, shift = 0, 0
    if shift:
        raise OffsetMapError("truncated varint")
    return values


def _runs(offsets: list[int], base: int) -> list[tuple[int, int]]:
    """Sorted offsets (all > base) as (gap from previous end, run length) pairs."""
    runs: list[tuple[int, int]] = []
    prev_end = base
    i = 0
    while i < len(offsets):
        start = offsets[i]
        j = i
        while j + 1 < len(offsets) and offsets[j + 1] == offsets[j] + 1:
            j += 1
        runs.append((start - prev_end, j - i + 1))
        prev_end = offsets[j] + 1
        i = j + 1
    return runs


def encode_done(base: int, done: list[int], limit: int = MAX_METADATA_CHARS) -> str:
    """Encode finished offsets (> base) relative to the committed offset ``base``; fits in ``limit`` chars."""
    return _encode(_runs(sorted(o for o in done if o > base), base), limit)


def encode_runs(base: int, runs: list[tuple[int, int]], limit: int | None = MAX_METADATA_CHARS) -> str:
    """``encode_done`` for sorted, disjoint runs ``[start, end)`` above ``base`` (no expansion to offsets);
    ``limit=None`` encodes everything (to measure)."""
    pairs, prev_end = [], base
    for start, end in runs:
        pairs.append((start - prev_end, end - start))
        prev_end = end
    return _encode(pairs, limit)


def _encode(runs: list[tuple[int, int]], limit: int | None) -> str:
    """(gap, length) pairs as metadata; past ``limit`` chars the farthest runs are dropped (a last resort: the
    runtime applies back-pressure at ``MAP_SOFT_LIMIT_CHARS`` long before)."""
    while True:
        raw = bytearray()
        for gap, length in runs:
            _varint(gap, raw)
            _varint(length, raw)
        text = METADATA_PREFIX + base64.b64encode(zlib.compress(bytes(raw), 9)).decode()
        if limit is None or len(text) <= limit or not runs:
            return text if runs else ""
        runs = runs[: len(runs) - max(1, len(runs) // 4)]


def decode_done(base: int, metadata: str | None, fetch: Callable[[str], bytes] | None = None) -> set[int]:
    """The finished offsets recorded in ``metadata`` for a partition committed at ``base``; a spilled map is read
    with ``fetch(digest)`` (the blob store's ``get``)."""
    if metadata and metadata.startswith(SPILL_PREFIX):
        if fetch is None:
            raise OffsetMapError("the finished-ahead map was spilled to the blob store, and none is at hand")
        digest = metadata[len(SPILL_PREFIX):]
        try:
            metadata = fetch(digest).decode()
        except Exception as e:  # missing, unreachable, not text: the jobs run again, nothing is lost
            raise OffsetMapError(f"spilled offset map {digest[:16]}... unreadable: {e}") from e
        if metadata.startswith(SPILL_PREFIX):
            raise OffsetMapError("a spilled offset map names another spilled map")
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return set()
    try:
        raw = zlib.decompress(base64.b64decode(metadata[len(METADATA_PREFIX):], validate=True))
    except (ValueError, zlib.error) as e:
        raise OffsetMapError(f"bad offset metadata: {e}") from e
    values = _read_varints(raw)
    if len(values) % 2:
        raise OffsetMapError("odd number of varints")
    done: set[int] = set()
    pos = base
    for gap, length in zip(values[::2], values[1::2], strict=True):
        if gap < 1 or length < 1 or length > 10_000_000:
            raise OffsetMapError("invalid run")
        start = pos + gap
        done.update(range(start, start + length))
        pos = start + length
    return done


class PartitionOffsets:
    """Offsets received from one partition and which of them finished.

    ``committable`` is the lowest received-but-unfinished offset, or one past the highest received when all
    are finished; offsets the broker never delivered (transaction markers, compaction gaps) are skipped.

    Finished offsets above it are kept as sorted, disjoint runs ``[start, end)`` updated in place, so a finish is a
    binary search plus a splice, and encoding the commit metadata costs the number of runs, not of finished jobs:
    one slow job low in a partition with 100k finished behind it is one run.
    """

    def __init__(self, start: int, done_ahead: Iterable[int] = ()) -> None:
        self._start = start
        self._pending: list[int] = []  # sorted received, unfinished
        self._starts: list[int] = []  # finished runs above the committable offset: starts ...
        self._ends: list[int] = []  # ... and ends (exclusive)
        self._high = start - 1  # highest offset received
        self._measured_runs, self._full = 0, False  # the last map-size measurement (see map_full)
        for offset in sorted(done_ahead):  # finished before a crash, per the last commit
            if offset >= start:
                self._add_done(offset)

    def receive(self, offset: int) -> bool:
        """Register a delivered offset; False if it is a duplicate or was finished before (skip it)."""
        if self._is_done(offset):
            self._high = max(self._high, offset)
            return False
        if offset <= self._high:
            return False
        self._high = offset
        bisect.insort(self._pending, offset)
        return True

    def finish(self, offset: int) -> None:
        i = bisect.bisect_left(self._pending, offset)
        if i == len(self._pending) or self._pending[i] != offset:
            raise KeyError(offset)
        del self._pending[i]
        self._add_done(offset)
        self._prune()

    def _is_done(self, offset: int) -> bool:
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and offset < self._ends[i]

    def _add_done(self, offset: int) -> None:
        i = bisect.bisect_right(self._starts, offset)  # runs[:i] start at or below offset
        joins_left = i > 0 and self._ends[i - 1] == offset
        joins_right = i < len(self._starts) and self._starts[i] == offset + 1
        if joins_left and joins_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif joins_left:
            self._ends[i - 1] = offset + 1
        elif joins_right:
            self._starts[i] = offset
        elif not (i > 0 and offset < self._ends[i - 1]):
            self._starts.insert(i, offset)
            self._ends.insert(i, offset + 1)

    def _prune(self) -> None:
        """Drop runs wholly below the committable offset (they are covered by the commit itself)."""
        k = bisect.bisect_right(self._ends, self.committable)
        if k:
            del self._starts[:k], self._ends[:k]

    @property
    def committable(self) -> int:
        if self._pending:
            return self._pending[0]
        return max(self._high + 1, self._start)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def runs(self) -> int:
        """Runs of finished offsets above the committable one (what the commit metadata must carry)."""
        return len(self._starts)

    @property
    def map_full(self) -> bool:
        """The finished-ahead map is near what commit metadata can carry: stop taking this partition's jobs until
        the low ones finish (truncating it would silently re-run finished work after a restart)."""
        runs = self.runs
        if runs <= MAP_RUNS_CHECKED:
            return False
        # Encoding costs O(runs): measure again only once the run count moved by a tenth since the last time.
        if abs(runs - self._measured_runs) * 10 >= self._measured_runs:
            self._measured_runs = runs
            self._full = len(self.metadata(limit=None)) > MAP_SOFT_LIMIT_CHARS
        return self._full

    @property
    def finished_ahead(self) -> int:
        """How many offsets above the committable one have finished (O(runs))."""
        return sum(end - start for start, end in self._runs_above())

    def done_ahead(self) -> list[int]:
        """Finished offsets above the committable one (what a restart must not run again)."""
        return [o for start, end in self._runs_above() for o in range(start, end)]

    def _runs_above(self) -> list[tuple[int, int]]:
        floor = self.committable
        return [(max(start, floor + 1), end) for start, end in zip(self._starts, self._ends, strict=True)
                if end > floor + 1]

    def metadata(self, limit: int | None = MAX_METADATA_CHARS) -> str:
        return encode_runs(self.committable, self._runs_above(), limit)


def commit_position(topic: str, partition: int, offsets: PartitionOffsets) -> TopicPartition:
    """The TopicPartition to commit: the committable offset and, when any, the finished-ahead map."""
    metadata = offsets.metadata()
    if metadata:
        return TopicPartition(topic, partition, offsets.committable, metadata)
    return TopicPartition(topic, partition, offsets.committable)


def poll_batch(consumer: Consumer, timeout: float, max_messages: int = 500) -> list[Message]:
    """Wait up to ``timeout`` for the first message, then take what else is already fetched, without waiting.

    ``Consumer.consume(n, timeout)`` blocks until it has ``n`` messages or the timeout passes, which would add the
    whole timeout to every job's latency under light load.
    """
    first = consumer.poll(timeout)
    if first is None:
        return []
    return [first, *consumer.consume(max_messages - 1, 0)]


def coordinates(msg: Message) -> tuple[str, int, int]:
    """Topic, partition and offset of a consumed message (always set on one that carries no error)."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError("message without coordinates")
    return topic, partition, offset
