"""Property tests for Saucer's parsers: delta decoding, paths, revisions, and the pack reader on random histories."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.ingest.errors import CorruptPack, InvalidReference, RevisionNotFound
from kiln.ingest.gitpack import apply_delta
from kiln.ingest.reader import split_path
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from tests.ingest.conftest import Ingested, ingest_into
from tests.ingest.gitrepos import Builder, all_commits, files_at, show, write


def _size(n: int) -> bytes:
    """A delta header's size: little-endian base 128."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@given(st.binary(max_size=64), st.binary(max_size=64))
def test_garbage_deltas_fail_typed(base: bytes, delta: bytes) -> None:
    # Arbitrary bytes almost never name this base's size: such a delta must be refused, typed.
    if not delta.startswith(_size(len(base))):
        with pytest.raises(CorruptPack):
            apply_delta(base, delta)


@given(st.binary(max_size=64), st.integers(0, 300), st.binary(max_size=64))
def test_deltas_with_a_valid_header_and_garbage_ops_yield_the_declared_size_or_fail_typed(
        base: bytes, declared: int, ops: bytes) -> None:
    try:
        out = apply_delta(base, _size(len(base)) + _size(declared) + ops)
    except CorruptPack:
        return
    assert len(out) == declared


@given(st.binary(max_size=300))
def test_paths_split_or_are_rejected(path: bytes) -> None:
    try:
        parts = split_path(path)
    except InvalidReference:
        return
    assert b"/".join(parts) == path.strip(b"/")
    assert all(p not in (b"", b".", b"..") and b"\0" not in p for p in parts)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rev=st.text(max_size=60))
def test_any_revision_string_resolves_or_fails_typed(rich: Ingested, rev: str) -> None:
    repo = rich.store.repository("acme/demo")
    try:
        commit = repo.resolve(rev)
    except (InvalidReference, RevisionNotFound):
        return
    assert commit in repo.manifest.commits


edits = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.binary(min_size=0, max_size=40)),
                 min_size=1, max_size=12)


@settings(max_examples=12, deadline=None)
@given(history=st.lists(edits, min_size=1, max_size=6))
def test_pack_reader_matches_git_on_random_histories(history: list[list[tuple[int, int, bytes]]]) -> None:
    # Files evolve by small splices, so pack-objects deltifies them and the reader must resolve delta chains.
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        b = Builder(root / "src")
        files = {i: (f"line {i}\n" * 50).encode() for i in range(4)}
        for commit_edits in history:
            for index, at, data in commit_edits:
                text = files[index]
                files[index] = text[:at] + data + text[at + len(data) // 2:]
                write(root / "src", f"dir{index % 2}/f{index}.txt", files[index])
            b.commit("edit")
        store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
        assert ingest_into(store, root / "work", IngestRequest(name="r", location=str(root / "src"))).status == \
            "ingested"
        repo = store.repository("r")
        for commit in all_commits(root / "src"):
            for path in files_at(root / "src", commit):
                assert repo.read(commit, path) == show(root / "src", commit, path)
