"""Property tests of the offset tracking and its commit-metadata encoding."""

from __future__ import annotations

import base64
import random
import string
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.streams.errors import OffsetMapError
from kiln.streams.offsets import MAX_METADATA_CHARS, METADATA_PREFIX, PartitionOffsets, decode_done, encode_done


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    """A start offset, delivered offsets (increasing, with gaps), and an order in which some finish."""
    start = draw(st.integers(0, 10**9))
    gaps = draw(st.lists(st.integers(1, 3), min_size=0, max_size=200))
    offsets, pos = [], start
    for g in gaps:
        pos += g - 1
        offsets.append(pos)
        pos += 1
    finished = draw(st.permutations(offsets))
    cut = draw(st.integers(0, len(offsets)))
    return start, offsets, list(finished[:cut])


@settings(max_examples=300, deadline=None)
@given(deliveries())
def test_committable_is_lowest_unfinished(case: tuple[int, list[int], list[int]]) -> None:
    start, offsets, finished = case
    tracker = PartitionOffsets(start)
    for o in offsets:
        assert tracker.receive(o)
    for o in finished:
        tracker.finish(o)
    unfinished = sorted(set(offsets) - set(finished))
    expected = unfinished[0] if unfinished else (offsets[-1] + 1 if offsets else start)
    assert tracker.committable == expected
    assert tracker.in_flight == len(unfinished)
    assert set(tracker.done_ahead()) == {o for o in finished if o > expected}


@settings(max_examples=300, deadline=None)
@given(deliveries())
def test_restart_skips_exactly_the_finished_ahead(case: tuple[int, list[int], list[int]]) -> None:
    """What a new owner re-runs after a crash is exactly what had not finished."""
    start, offsets, finished = case
    before = PartitionOffsets(start)
    for o in offsets:
        before.receive(o)
    for o in finished:
        before.finish(o)
    committed, metadata = before.committable, before.metadata()
    assert len(metadata) <= MAX_METADATA_CHARS

    after = PartitionOffsets(committed, decode_done(committed, metadata))
    rerun = [o for o in offsets if o >= committed and after.receive(o)]
    assert rerun == sorted(set(offsets) - set(finished))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**12), st.sets(st.integers(1, 10**6), max_size=3000))
def test_encoding_round_trips_or_drops_only_farthest(base: int, deltas: set[int]) -> None:
    done = sorted(base + d for d in deltas)
    text = encode_done(base, done)
    assert len(text) <= MAX_METADATA_CHARS
    decoded = decode_done(base, text)
    assert decoded <= set(done)  # never claims a job finished that did not
    if decoded != set(done):  # truncated: what survived is a prefix (nearest the committed offset)
        assert sorted(decoded) == done[: len(decoded)]


def test_dense_map_of_many_finished_jobs_fits() -> None:
    done = [o for o in range(1, 200_001) if o % 7]  # 170k finished jobs with holes
    text = encode_done(0, done)
    assert len(text) <= MAX_METADATA_CHARS
    assert len(decode_done(0, text)) > 1000


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_decoding_garbage_fails_cleanly(text: str) -> None:
    try:
        decoded = decode_done(5, "k1:" + text)
    except OffsetMapError:
        return
    assert all(o > 5 for o in decoded)  # the text happened to be a map: it names only offsets past the commit
    assert not set(text) - set(string.ascii_letters + string.digits + "+/=")  # else it had to be refused


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 127), max_size=40))
def test_decoding_garbage_runs_fails_typed_or_yields_a_map_past_the_commit(varints: list[int]) -> None:
    """Well-formed metadata around arbitrary one-byte varints: runs of zero length or zero gap (which would name
    the committed offset itself, or nothing) are refused; anything accepted names offsets past the commit and
    round-trips through the encoder."""
    text = METADATA_PREFIX + base64.b64encode(zlib.compress(bytes(varints))).decode()
    try:
        decoded = decode_done(5, text)
    except OffsetMapError:
        assert len(varints) % 2 or any(v < 1 for v in varints)
        return
    assert len(varints) % 2 == 0 and all(v >= 1 for v in varints)
    assert all(o > 5 for o in decoded) and len(decoded) == sum(varints[1::2])
    assert decode_done(5, encode_done(5, sorted(decoded))) == decoded


def test_foreign_metadata_is_ignored() -> None:
    assert decode_done(10, "") == set()
    assert decode_done(10, "written by another tool") == set()
    with pytest.raises(OffsetMapError):
        decode_done(10, "k1:%%%")


def test_duplicates_and_recorded_offsets_are_not_run() -> None:
    tracker = PartitionOffsets(100, {102, 103})
    assert tracker.receive(100)
    assert tracker.receive(101)
    assert not tracker.receive(101)  # redelivered duplicate
    assert not tracker.receive(102) and not tracker.receive(103)
    tracker.finish(101)
    assert tracker.committable == 100 and tracker.done_ahead() == [101, 102, 103]
    tracker.finish(100)
    assert tracker.committable == 104 and tracker.done_ahead() == []


def test_a_map_that_would_not_fit_asks_for_back_pressure_instead_of_being_truncated() -> None:
    """Jobs finishing out of order scatter the map; before it outgrows the commit metadata the tracker says so
    (the runtime then stops taking that partition's jobs), and what it encodes is never silently cut."""
    rng = random.Random(5)
    tracker = PartitionOffsets(0)
    for o in range(200_000):
        tracker.receive(o)
    finished, o = [], 0
    while not tracker.map_full:  # scattered finishes (irregular gaps: nothing for zlib to fold)
        o += rng.randint(2, 200)
        tracker.finish(o)
        finished.append(o)
    assert o < 200_000 and len(tracker.metadata(limit=None)) <= MAX_METADATA_CHARS
    assert decode_done(tracker.committable, tracker.metadata()) == set(finished)
    for o in sorted(set(range(finished[-1])) - set(finished)):  # the holes finish: the map collapses
        tracker.finish(o)
    assert not tracker.map_full and tracker.committable == finished[-1] + 1 and tracker.done_ahead() == []
