"""Saucer's errors, under kiln's root ``KilnError``.

SaucerError
├── InvalidLocation     the repository location is not acceptable (unknown transport, option injection)
│   └── LocationOutsideRoots  a local repository whose git directory, objects or links lead outside the roots
├── DownloadFailed      every download strategy failed; ``reason`` is the class of failure
├── InvalidReference    a revision or path is malformed or absurd (HTTP 400)
├── NotFound            (HTTP 404)
│   ├── RepositoryNotFound
│   ├── RevisionNotFound
│   ├── PathNotFound
│   └── ObjectNotFound  an object id is absent from the pack
├── NotAFile            the path names a tree or a submodule, not a blob (HTTP 409)
├── CorruptPack         stored pack, index or manifest bytes are inconsistent
└── RewriteFailed       the rewrite cannot apply to the source (e.g. the path was never in its history)
"""

from __future__ import annotations

from kiln.schemas.ingest import FailureReason
from kiln.streams.errors import KilnError


class SaucerError(KilnError):
    """Root of the repository store's errors."""


class InvalidLocation(SaucerError):
    """The location cannot be ingested safely."""


class LocationOutsideRoots(InvalidLocation):
    """A local location, or what git would follow from it (``.git`` file or link, ``commondir``, alternates, a link
    inside the git directory), lies outside ``KILN_INGEST_LOCAL_ROOTS``."""


class DownloadFailed(SaucerError):
    """All download strategies failed."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class InvalidReference(SaucerError):
    """A revision or path that can never name anything."""


class NotFound(SaucerError):
    """Nothing by that name."""


class RepositoryNotFound(NotFound):
    pass


class RevisionNotFound(NotFound):
    pass


class PathNotFound(NotFound):
    pass


class ObjectNotFound(NotFound):
    pass


class NotAFile(SaucerError):
    """The path exists but is a directory or a submodule entry."""


class CorruptPack(SaucerError):
    """Stored artifacts are inconsistent with each other."""


class RewriteFailed(SaucerError):
    """The rewrite cannot apply to the source (e.g. the path was never in its history)."""
