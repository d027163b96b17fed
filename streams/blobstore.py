"""Content-addressed, write-once blob storage: a local filesystem store (embedded default) and S3.

A blob's name is its digest (``sha256:<hex>``), so writes are idempotent and a reader can verify what it got.
Both implementations stream: large objects never sit whole in memory. Beside blobs, a store keeps small mutable
*names* (e.g. a repository name -> its current manifest), replaced atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

from kiln.streams.errors import BlobCorrupt, BlobError, BlobNotFound, BlobUnavailable, ConfigError
from kiln.streams.extras import missing_extra
from kiln.streams.settings import KilnSettings

CHUNK = 1 << 20
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")


@dataclass(frozen=True)
class BlobRef:
    digest: str
    size: int


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size: int
    modified: float
    """Unix time the blob was (last) written."""


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _check_digest(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise BlobError(f"not a sha256 digest: {digest!r}")
    return digest.removeprefix("sha256:")


def _check_name(name: str) -> str:
    if len(name) > 512 or not _NAME.match(name):
        raise BlobError(f"not a valid name: {name!r}")
    return name


class _HashingReader:
    """Wraps a readable stream and hashes what passes through, so uploads need one pass only."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._hash = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        chunk = self._stream.read(n)
        self._hash.update(chunk)
        self.size += len(chunk)
        return chunk

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


class BlobStore(ABC):
    """Write-once, content-addressed storage."""

    @abstractmethod
    def put_stream(self, stream: IO[bytes]) -> BlobRef:
        """Store everything readable from ``stream``; returns its digest and size."""

    @abstractmethod
    def open(self, digest: str) -> IO[bytes]:
        """A stream over the blob's bytes; raises BlobNotFound."""

    @abstractmethod
    def exists(self, digest: str) -> bool: ...

    @abstractmethod
    def set_name(self, name: str, data: bytes) -> None:
        """Point ``name`` at ``data`` (small), replacing what it held; readers see old or new, never a mix."""

    @abstractmethod
    def get_name(self, name: str) -> bytes:
        """What ``name`` holds; raises BlobNotFound."""

    @abstractmethod
    def list_names(self, prefix: str) -> list[str]:
        """Names under ``prefix/``, sorted, without the prefix."""

    @abstractmethod
    def blobs(self) -> Iterator[BlobInfo]:
        """Every stored blob (for the garbage collector, ``streams/gc.py``)."""

    @abstractmethod
    def delete(self, digest: str) -> None:
        """Remove a blob (absent: nothing to do). Only the garbage collector calls this."""

    @abstractmethod
    def all_names(self) -> list[str]:
        """Every name, with its full path."""

    def put(self, data: bytes) -> BlobRef:
        return self.put_stream(io.BytesIO(data))

    def local_copy(self, digest: str, cache_dir: Path) -> Path:
        """A verified local file with the blob's bytes (downloaded once into ``cache_dir``), e.g. to mmap it."""
        path = cache_dir / _check_digest(digest)
        if path.is_file():
            return path
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".part-")
        try:
            hasher = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                for chunk in self.iter_chunks(digest):
                    hasher.update(chunk)
                    out.write(chunk)
            if "sha256:" + hasher.hexdigest() != digest:
                raise BlobCorrupt(f"blob {digest} is corrupt")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return path

    def get(self, digest: str) -> bytes:
        """The whole blob, verified against its digest."""
        with self.open(digest) as f:
            data = f.read()
        if digest_of(data) != digest:
            raise BlobCorrupt(f"blob {digest} is corrupt")
        return data

    def iter_chunks(self, digest: str) -> Iterator[bytes]:
        with self.open(digest) as f:
            while chunk := f.read(CHUNK):
                yield chunk


class FileBlobStore(BlobStore):
    """Blobs as files ``<root>/sha256/<2 hex>/<hex>``; written to a temp file and renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "tmp").mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        hexd = _check_digest(digest)
        return self.root / "sha256" / hexd[:2] / hexd

    def put_stream(self, stream: IO[bytes]) -> BlobRef:
        reader = _HashingReader(stream)
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := reader.read(CHUNK):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            final = self._path(reader.digest)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp, 0o444)
            # rename is atomic; a concurrent writer of the same digest wrote the same bytes.
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return BlobRef(reader.digest, reader.size)

    def open(self, digest: str) -> IO[bytes]:
        try:
            return self._path(digest).open("rb")
        except FileNotFoundError:
            raise BlobNotFound(digest) from None

    def exists(self, digest: str) -> bool:
        return self._path(digest).is_file()

    def local_copy(self, digest: str, cache_dir: Path) -> Path:
        path = self._path(digest)
        if not path.is_file():
            raise BlobNotFound(digest)
        return path

    def set_name(self, name: str, data: bytes) -> None:
        path = self.root / "names" / _check_name(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)

    def get_name(self, name: str) -> bytes:
        try:
            return (self.root / "names" / _check_name(name)).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFound(name) from None

    def list_names(self, prefix: str) -> list[str]:
        base = self.root / "names" / _check_name(prefix)
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())

    def all_names(self) -> list[str]:
        base = self.root / "names"
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()) if base.is_dir() else []

    def blobs(self) -> Iterator[BlobInfo]:
        for path in sorted((self.root / "sha256").glob("*/*")):
            if _DIGEST.match(f"sha256:{path.name}"):
                stat = path.stat()
                yield BlobInfo(f"sha256:{path.name}", stat.st_size, stat.st_mtime)

    def delete(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(digest).unlink()


@contextlib.contextmanager
def _s3_errors(what: str) -> Iterator[None]:
    """Any failure of the S3 client (connection, refusal, a missing bucket, a failed upload) as
    ``BlobUnavailable``; kiln's own errors (e.g. ``BlobNotFound``) pass through."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError, Boto3Error) as e:
        raise BlobUnavailable(f"S3 {what}: {e}") from e


class S3BlobStore(BlobStore):
    """Blobs as objects ``<prefix>sha256/<hex>`` in one bucket.

    A stream is uploaded (multipart above 8 MiB) to a unique temporary key while it is hashed, then copied
    server-side to its content address and the temporary object deleted: readers never see a partial object.
    """

    def __init__(self, client: Any, bucket: str, prefix: str = "") -> None:
        from boto3.s3.transfer import TransferConfig

        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.transfer = TransferConfig(multipart_threshold=8 * CHUNK, multipart_chunksize=8 * CHUNK)

    @classmethod
    def from_settings(cls, settings: KilnSettings, bucket: str, prefix: str = "") -> S3BlobStore:
        try:
            import boto3
            from botocore.config import Config
        except ModuleNotFoundError as e:
            raise missing_extra(e, "a blob store on S3") from None

        client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint,
            aws_access_key_id=settings.s3_access_key,
            aws_secret_access_key=settings.s3_secret_key,
            region_name=settings.s3_region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}),
        )
        return cls(client, bucket, prefix)

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        with _s3_errors(f"bucket {self.bucket!r} at {self.client.meta.endpoint_url}"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError:
                self.client.create_bucket(Bucket=self.bucket)

    def _key(self, digest: str) -> str:
        return f"{self.prefix}sha256/{_check_digest(digest)}"

    def put_stream(self, stream: IO[bytes]) -> BlobRef:
        reader = _HashingReader(stream)
        tmp_key = f"{self.prefix}tmp/{uuid.uuid4().hex}"
        with _s3_errors("put"):
            self.client.upload_fileobj(reader, self.bucket, tmp_key, Config=self.transfer)
            try:
                # Copied even when the digest exists (same bytes, readers see no change): a blob written again
                # is fresh in the garbage collector's eyes, as a file store's rename makes it.
                self.client.copy({"Bucket": self.bucket, "Key": tmp_key}, self.bucket, self._key(reader.digest),
                                 Config=self.transfer)
            finally:
                self.client.delete_object(Bucket=self.bucket, Key=tmp_key)
        return BlobRef(reader.digest, reader.size)

    def open(self, digest: str) -> IO[bytes]:
        from botocore.exceptions import ClientError

        with _s3_errors(f"get {digest}"):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=self._key(digest))["Body"]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise BlobNotFound(digest) from None
                raise
        return body  # type: ignore[no-any-return]

    def set_name(self, name: str, data: bytes) -> None:
        with _s3_errors(f"put name {name}"):
            self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}names/{_check_name(name)}", Body=data)

    def get_name(self, name: str) -> bytes:
        from botocore.exceptions import ClientError

        with _s3_errors(f"get name {name}"):
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}names/{_check_name(name)}")
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise BlobNotFound(name) from None
                raise
            return obj["Body"].read()  # type: ignore[no-any-return]

    def list_names(self, prefix: str) -> list[str]:
        base = f"{self.prefix}names/{_check_name(prefix)}/"
        names: list[str] = []
        with _s3_errors(f"list {prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                names.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        return sorted(names)

    def all_names(self) -> list[str]:
        base = f"{self.prefix}names/"
        return sorted(key[len(base):] for key, _size, _when in self._objects(base))

    def blobs(self) -> Iterator[BlobInfo]:
        base = f"{self.prefix}sha256/"
        for key, size, when in self._objects(base):
            digest = f"sha256:{key[len(base):]}"
            if _DIGEST.match(digest):
                yield BlobInfo(digest, size, when)

    def _objects(self, base: str) -> Iterator[tuple[str, int, float]]:
        with _s3_errors(f"list {base}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    yield obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp()

    def delete(self, digest: str) -> None:
        with _s3_errors(f"delete {digest}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(digest))

    def exists(self, digest: str) -> bool:
        from botocore.exceptions import ClientError

        with _s3_errors(f"head {digest}"):
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._key(digest))
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                    return False
                raise
        return True


def open_blob_store(settings: KilnSettings) -> BlobStore:
    """The store named by ``KILN_BLOB_STORE`` (``file:///dir`` or ``s3://bucket/prefix``)."""
    url = settings.blob_store or f"file://{settings.cache / 'blobs'}"
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileBlobStore(Path(parsed.path))
    if parsed.scheme == "s3":
        store = S3BlobStore.from_settings(settings, parsed.netloc, parsed.path)
        store.ensure_bucket()
        return store
    raise ConfigError(f"KILN_BLOB_STORE must be file:// or s3://, got {url!r}")
