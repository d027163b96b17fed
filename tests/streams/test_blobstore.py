"""BlobStore: content-addressed and write-once, on the local filesystem and on the real S3 server."""

from __future__ import annotations

import hashlib
import io
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.streams.blobstore import BlobStore, FileBlobStore, S3BlobStore, digest_of, open_blob_store
from kiln.streams.errors import BlobCorrupt, BlobError, BlobNotFound, ConfigError
from kiln.streams.settings import KilnSettings


class _Chunks(io.RawIOBase):
    """n pseudo-random bytes made on demand (64 KiB blocks seeded by position): never held whole in memory."""

    BLOCK = 1 << 16

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        block, offset = divmod(self.pos, self.BLOCK)
        n = min(len(b), self.n - self.pos, self.BLOCK - offset)
        b[:n] = random.Random(block).randbytes(self.BLOCK)[offset : offset + n]
        self.pos += n
        return n


def test_round_trip_and_idempotent(store: BlobStore) -> None:
    ref = store.put(b"hello kiln")
    assert ref.digest == digest_of(b"hello kiln") and ref.size == 10
    assert store.exists(ref.digest)
    assert store.get(ref.digest) == b"hello kiln"
    assert store.put(b"hello kiln") == ref


def test_missing_and_invalid_digests(store: BlobStore) -> None:
    with pytest.raises(BlobNotFound):
        store.get(digest_of(b"never stored"))
    assert not store.exists(digest_of(b"never stored"))
    with pytest.raises(BlobError):
        store.get("sha256:../../etc/passwd")


def test_large_stream_is_multipart_and_verified(store: BlobStore) -> None:
    size = 21 * 1024 * 1024 + 123  # above the 8 MiB multipart threshold: three parts on S3
    ref = store.put_stream(io.BufferedReader(_Chunks(size)))
    expected = hashlib.sha256()
    for chunk in io.BufferedReader(_Chunks(size)):
        expected.update(chunk)
    assert ref.size == size and ref.digest == "sha256:" + expected.hexdigest()
    got = hashlib.sha256()
    total = 0
    for chunk in store.iter_chunks(ref.digest):
        got.update(chunk)
        total += len(chunk)
    assert total == size and got.hexdigest() == expected.hexdigest()


def test_s3_multipart_upload_lands_as_one_object(s3_settings: KilnSettings, unique: str) -> None:
    store = S3BlobStore.from_settings(s3_settings, f"kiln-test-{unique}")
    store.ensure_bucket()
    data = os.urandom(17 * 1024 * 1024)
    ref = store.put(data)
    head = store.client.head_object(Bucket=store.bucket, Key=f"sha256/{ref.digest[7:]}")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-3")  # 3 parts of 8 MiB: a real multipart object
    keys = [o["Key"] for o in store.client.list_objects_v2(Bucket=store.bucket).get("Contents", [])]
    assert keys == [f"sha256/{ref.digest[7:]}"]  # the temporary upload key is gone


def test_file_store_detects_corruption(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    ref = store.put(b"precious")
    path = tmp_path / "sha256" / ref.digest[7:9] / ref.digest[7:]
    os.chmod(path, 0o644)
    path.write_bytes(b"tampered")
    with pytest.raises(BlobCorrupt):
        store.get(ref.digest)


def test_unknown_store_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        open_blob_store(KilnSettings(blob_store="ftp://x"))


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=4096))
def test_file_store_property(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    store = FileBlobStore(tmp_path_factory.mktemp("prop"))
    ref = store.put(data)
    assert store.get(ref.digest) == data and ref.size == len(data)


def test_s3_failures_are_typed_and_transient(s3_settings: KilnSettings, unique: str) -> None:
    """A bucket that is gone (or an S3 outage) surfaces as ``BlobUnavailable``: a transient ``KilnError`` the
    runtime retries, never a raw botocore exception that would stop a worker."""
    from kiln.streams.errors import BlobUnavailable, TransientJobError

    gone = S3BlobStore.from_settings(s3_settings, f"kiln-missing-{unique}")
    with pytest.raises(BlobUnavailable) as raised:
        gone.put(b"result too large for a message")
    assert isinstance(raised.value, TransientJobError)
    for call in (lambda: gone.get(digest_of(b"x")), lambda: gone.get_name("a/b"),
                 lambda: gone.set_name("a/b", b"x"), lambda: gone.list_names("a")):
        with pytest.raises(BlobUnavailable):
            call()
