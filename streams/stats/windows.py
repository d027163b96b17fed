"""Per-minute sums kept in a bounded ring of event-time buckets, so a table never grows with time and a replayed
record lands in the bucket of when it happened, not of when it was read.

A ring slot holds ``[bucket start, sum]``; writing an event of a newer bucket resets the slot, an event older than
the slot's bucket is too late to count. "The last minute" is the six complete buckets before the current one: a
full 60 s of data, at most one bucket old.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableMapping

BUCKET_S = 10
RING = 12
WINDOW_S = 60
SEP = "\t"

Slot = list[float]


def bucket_start(t: float) -> float:
    return math.floor(t / BUCKET_S) * BUCKET_S


def slot_key(stage: str, metric: str, t: float) -> str:
    return SEP.join((stage, metric, str(int(bucket_start(t) // BUCKET_S) % RING)))


def add(table: MutableMapping[str, Slot], stage: str, metric: str, t: float, amount: float) -> None:
    """Add ``amount`` at event time ``t`` (assigning the slot anew, so a changelogged table records the change)."""
    key, start = slot_key(stage, metric, t), bucket_start(t)
    slot = table.get(key)
    if slot is not None and slot[0] > start:
        return  # older than the ring remembers
    table[key] = [start, (slot[1] if slot is not None and slot[0] == start else 0.0) + amount]


def last_minute(get: Callable[[str], Slot | None], stage: str, metric: str, now: float) -> float:
    """The sum over the complete buckets of the minute before ``now``'s bucket."""
    current = bucket_start(now)
    total = 0.0
    for index in range(RING):
        slot = get(SEP.join((stage, metric, str(index))))
        if slot is not None and current - WINDOW_S <= slot[0] < current:
            total += slot[1]
    return total


def metrics_of(keys: Iterable[str], stage: str, prefix: str) -> set[str]:
    """The metric names starting with ``prefix`` that ``stage`` has slots for (e.g. every failure reason)."""
    found = set()
    for key in keys:
        parts = key.split(SEP)
        if len(parts) == 3 and parts[0] == stage and parts[1].startswith(prefix):
            found.add(parts[1])
    return found
