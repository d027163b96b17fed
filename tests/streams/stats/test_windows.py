"""The event-time ring: what "the last minute" sums is exactly the events of the six complete buckets before now,
whatever order they arrive in, as long as none is older than the ring."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kiln.streams.stats import windows

NOW = 1_000_000.0


@given(st.lists(st.tuples(st.floats(min_value=NOW - 115, max_value=NOW, allow_nan=False),
                          st.integers(min_value=1, max_value=5)), max_size=60),
       st.floats(min_value=NOW, max_value=NOW + 9.99))
def test_last_minute_is_the_complete_buckets_before_now(events: list[tuple[float, int]], now: float) -> None:
    table: dict[str, list[float]] = {}
    for t, amount in sorted(events):  # in time order, as one producer's results arrive
        windows.add(table, "s", "done", t, amount)
    current = windows.bucket_start(now)
    expected = sum(a for t, a in events if current - windows.WINDOW_S <= windows.bucket_start(t) < current)
    assert windows.last_minute(table.get, "s", "done", now) == expected


@given(st.permutations(list(range(30))))
def test_arrival_order_within_the_ring_does_not_matter(order: list[int]) -> None:
    events = [(NOW - 59 + 2 * i, 1) for i in range(30)]
    table: dict[str, list[float]] = {}
    for i in order:
        windows.add(table, "s", "done", *events[i])
    in_order: dict[str, list[float]] = {}
    for t, amount in events:
        windows.add(in_order, "s", "done", t, amount)
    assert windows.last_minute(table.get, "s", "done", NOW + 60) == windows.last_minute(
        in_order.get, "s", "done", NOW + 60)


def test_an_event_older_than_the_ring_is_dropped_not_mixed_in() -> None:
    table: dict[str, list[float]] = {}
    windows.add(table, "s", "done", NOW, 1)
    windows.add(table, "s", "done", NOW - windows.RING * windows.BUCKET_S, 7)  # same slot, two minutes earlier
    assert windows.last_minute(table.get, "s", "done", NOW + windows.BUCKET_S) == 1
    assert windows.metrics_of(table, "s", "do") == {"done"}
