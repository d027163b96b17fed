"""``KILN_INGEST_LOCAL_ROOTS`` tried as an attacker who controls a location inside a root would: every way git
follows from a repository's folder to another one (a ``.git`` file or link, a worktree's ``commondir``,
``objects/info/alternates``, links inside the git directory, git's own ``.git`` suffixes, the environment) is
taken through the real ingest path towards a repository outside the roots that holds a secret. Each must end in a
failed ``invalid_location`` event with nothing of the secret stored; the same constructions that stay inside the
roots still ingest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.ingest.errors import InvalidLocation, LocationOutsideRoots
from kiln.ingest.policy import IngestPolicy, vet
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.streams.blobstore import FileBlobStore
from tests.ingest.gitrepos import Builder, git, write

SECRET = "the worker's private repository\n"


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path, IngestPolicy]:
    """(the allowed root, a repository outside it holding SECRET, the policy allowing only the root)."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "private"
    b = Builder(outside)
    write(outside, "secret.txt", SECRET)
    b.commit("secret")
    return allowed, outside, IngestPolicy(local_roots=[allowed])


@pytest.fixture
def store(tmp_path: Path) -> SaucerStore:
    return SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")


async def _ingest(store: SaucerStore, tmp_path: Path, location: str, policy: IngestPolicy) -> IngestEvent:
    return await ingest(IngestRequest(name="acme/x", location=location), "r", store, tmp_path / "work",
                        policy=policy)


def _holds_secret(store: SaucerStore) -> bool:
    if "acme/x" not in store.names():
        return False
    repo = store.repository("acme/x")
    return any(entry.path == b"secret.txt" for oid, _ in repo.commits() for entry in repo.walk(oid))


async def _refused(store: SaucerStore, tmp_path: Path, location: Path, policy: IngestPolicy, why: str) -> None:
    for form in (str(location), f"file://{location}"):
        event = await _ingest(store, tmp_path, form, policy)
        assert (event.status, event.reason) == ("failed", "invalid_location"), (form, event)
        assert "KILN_INGEST_LOCAL_ROOTS" in (event.detail or "") and why in (event.detail or ""), event.detail
    with pytest.raises(LocationOutsideRoots):
        vet(str(location), False, policy)
    assert not _holds_secret(store)


async def test_git_file_pointing_outside(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore,
                                         tmp_path: Path) -> None:
    allowed, outside, policy = roots
    (allowed / "repo").mkdir()
    (allowed / "repo" / ".git").write_text(f"gitdir: {outside / '.git'}\n")
    await _refused(store, tmp_path, allowed / "repo", policy, ".git file")
    relative = allowed / "relative"
    relative.mkdir()
    (relative / ".git").write_text(f"gitdir: ../../{outside.name}/.git\n")
    await _refused(store, tmp_path, relative, policy, ".git file")


async def test_worktree_of_a_repository_outside(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore,
                                                tmp_path: Path) -> None:
    allowed, outside, policy = roots
    git(outside, "worktree", "add", "-q", str(allowed / "wt"))  # its .git is a file naming outside/.git/worktrees
    await _refused(store, tmp_path, allowed / "wt", policy, ".git file")
    # The worktree's own git directory copied into the root: its ``commondir`` still names the outside repository.
    shutil.copytree(outside / ".git" / "worktrees" / "wt", allowed / "copied" / ".git")
    (allowed / "copied" / ".git" / "commondir").write_text(f"{outside / '.git'}\n")
    await _refused(store, tmp_path, allowed / "copied", policy, "commondir")


async def test_git_link_pointing_outside(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore,
                                         tmp_path: Path) -> None:
    allowed, outside, policy = roots
    (allowed / "repo").mkdir()
    (allowed / "repo" / ".git").symlink_to(outside / ".git")
    await _refused(store, tmp_path, allowed / "repo", policy, "link")


async def test_alternates_outside(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore, tmp_path: Path) -> None:
    allowed, outside, policy = roots
    # ``clone --shared`` writes objects/info/alternates naming the source's objects: the clone holds refs only.
    git(allowed, "clone", "-q", "--bare", "--shared", str(outside), str(allowed / "shared.git"))
    assert (allowed / "shared.git" / "objects" / "info" / "alternates").exists()
    await _refused(store, tmp_path, allowed / "shared.git", policy, "alternates")
    # The same, relative and chained: an alternate inside the root whose own alternates lead out.
    git(allowed, "clone", "-q", "--bare", "--shared", str(allowed / "shared.git"), str(allowed / "chained.git"))
    await _refused(store, tmp_path, allowed / "chained.git", policy, "alternates")


async def test_links_inside_the_git_directory(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore,
                                              tmp_path: Path) -> None:
    allowed, outside, policy = roots
    git(allowed, "clone", "-q", "--bare", str(outside), str(allowed / "objects.git"))
    shutil.rmtree(allowed / "objects.git" / "objects")
    (allowed / "objects.git" / "objects").symlink_to(outside / ".git" / "objects")
    await _refused(store, tmp_path, allowed / "objects.git", policy, "link")
    # One pack file linked out of an otherwise ordinary repository.
    git(outside, "repack", "-q", "-a", "-d")
    pack = next((outside / ".git" / "objects" / "pack").glob("*.pack"))
    git(allowed, "clone", "-q", "--bare", str(outside), str(allowed / "pack.git"))
    for own in (allowed / "pack.git" / "objects" / "pack").glob("*.pack"):
        own.unlink()
        own.symlink_to(pack)
    await _refused(store, tmp_path, allowed / "pack.git", policy, "link")


async def test_git_suffixes_leading_outside(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore,
                                            tmp_path: Path) -> None:
    """``git fetch /root/name`` also tries ``/root/name.git``: a location that does not exist but whose ``.git``
    sibling is a link out of the root."""
    allowed, outside, policy = roots
    (allowed / "name.git").symlink_to(outside)
    event = await _ingest(store, tmp_path, str(allowed / "name"), policy)
    assert (event.status, event.reason) == ("failed", "invalid_location"), event
    with pytest.raises(InvalidLocation):
        vet(str(allowed / "name"), False, policy)
    assert not _holds_secret(store)


async def test_worker_environment_never_redirects_objects(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refs inside the root, their objects only outside: git's object-directory variables in the worker's
    environment would complete the repository; git runs with an environment of its own, so they do not."""
    allowed, outside, policy = roots
    git(allowed, "clone", "-q", "--bare", "--shared", str(outside), str(allowed / "refs-only.git"))
    (allowed / "refs-only.git" / "objects" / "info" / "alternates").unlink()
    monkeypatch.setenv("GIT_ALTERNATE_OBJECT_DIRECTORIES", str(outside / ".git" / "objects"))
    monkeypatch.setenv("GIT_OBJECT_DIRECTORY", str(outside / ".git" / "objects"))
    event = await _ingest(store, tmp_path, str(allowed / "refs-only.git"), policy)
    assert event.status == "failed", event
    assert not _holds_secret(store)


async def test_the_same_constructions_inside_the_roots_ingest(roots: tuple[Path, Path, IngestPolicy],
                                                              store: SaucerStore, tmp_path: Path) -> None:
    allowed, outside, policy = roots
    shutil.copytree(outside, allowed / "main")
    git(allowed / "main", "worktree", "add", "-q", str(allowed / "wt"))
    git(allowed, "clone", "-q", "--bare", "--shared", str(allowed / "main"), str(allowed / "shared.git"))
    (allowed / "linked").mkdir()
    (allowed / "linked" / ".git").symlink_to(allowed / "main" / ".git")
    for location in ("main", "wt", "shared.git", "linked"):
        event = await _ingest(store, tmp_path, str(allowed / location), policy)
        assert event.status == "ingested", (location, event)
        assert _holds_secret(store)


async def test_percent_encoded_file_url_leading_outside(roots: tuple[Path, Path, IngestPolicy], store: SaucerStore,
                                                        tmp_path: Path) -> None:
    """Git percent-decodes ``file://`` paths: ``%2E%2E`` is ``..`` to git, a plain name to a path check."""
    allowed, outside, policy = roots
    location = f"file://{allowed}/%2E%2E/{outside.name}"
    event = await _ingest(store, tmp_path, location, policy)
    assert (event.status, event.reason) == ("failed", "invalid_location"), event
    assert "KILN_INGEST_LOCAL_ROOTS" in (event.detail or "")
    assert not _holds_secret(store)
