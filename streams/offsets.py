"""Per-partition offset tracking for out-of-order completion, its compact commit-metadata encoding, and the
consumer-side helpers that feed it.

The committed offset of a partition is its lowest unfinished offset. Jobs finished *beyond* it are remembered in
the commit's metadata string (run-length encoded, zlib-compressed, base64; bounded well under the broker's
4 KiB limit), so after a crash or rebalance the new owner skips them and only the jobs really in flight run
again. When the map would not fit, the farthest runs are dropped: forgetting a finished job costs a re-run, never a
lost job.
"""

from __future__ import annotations

import base64
import bisect
import zlib

from confluent_kafka import Consumer, Message, TopicPartition

from kiln.streams.errors import KilnError

METADATA_PREFIX = "k1:"
MAX_METADATA_CHARS = 3000


class OffsetMapError(KilnError):
    """Commit metadata that does not decode (written by something else, or corrupt)."""


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
    runs = _runs(sorted(o for o in done if o > base), base)
    while True:
        raw = bytearray()
        for gap, length in runs:
            _varint(gap, raw)
            _varint(length, raw)
        text = METADATA_PREFIX + base64.b64encode(zlib.compress(bytes(raw), 9)).decode()
        if len(text) <= limit or not runs:
            return text if runs else ""
        runs = runs[: len(runs) - max(1, len(runs) // 4)]


def decode_done(base: int, metadata: str | None) -> set[int]:
    """The finished offsets recorded in ``metadata`` for a partition committed at ``base``."""
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
    """

    def __init__(self, start: int, done_ahead: set[int] | None = None) -> None:
        self._start = start
        self._pending: list[int] = []  # sorted received, unfinished
        self._done: set[int] = set()  # finished above the lowest pending
        self._high = start - 1  # highest offset received
        self.recorded_done = set(done_ahead or ())  # finished before a crash, per the last commit

    def receive(self, offset: int) -> bool:
        """Register a delivered offset; False if it is a duplicate or was finished before (skip it)."""
        if offset <= self._high and offset not in self.recorded_done:
            return False
        self._high = max(self._high, offset)
        if offset in self.recorded_done:
            self.recorded_done.discard(offset)
            self._done.add(offset)
            return False
        bisect.insort(self._pending, offset)
        return True

    def finish(self, offset: int) -> None:
        i = bisect.bisect_left(self._pending, offset)
        if i == len(self._pending) or self._pending[i] != offset:
            raise KeyError(offset)
        del self._pending[i]
        self._done.add(offset)
        self._prune()

    def _prune(self) -> None:
        floor = self.committable
        if self._done and min(self._done) < floor:
            self._done = {o for o in self._done if o >= floor}

    @property
    def committable(self) -> int:
        if self._pending:
            return self._pending[0]
        return max(self._high + 1, self._start)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def done_ahead(self) -> list[int]:
        """Finished offsets above the committable one (what a restart must not run again)."""
        floor = self.committable
        return sorted(o for o in self._done | self.recorded_done if o > floor)

    def metadata(self) -> str:
        return encode_done(self.committable, self.done_ahead())


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
