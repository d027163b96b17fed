"""Saucer's reader against git itself: every file at every revision, revisions, paths, determinism, S3, rewrites."""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest

from kiln.ingest.errors import InvalidReference, NotAFile, PathNotFound, RepositoryNotFound, RevisionNotFound
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import HistoryRewrite, IngestRequest
from kiln.streams.blobstore import FileBlobStore, S3BlobStore
from kiln.streams.settings import KilnSettings
from tests.ingest.conftest import Ingested, ingest_into
from tests.ingest.gitrepos import NON_UTF8, all_commits, files_at, git, show

KINDS = {"100644": "file", "100755": "executable", "120000": "symlink", "160000": "submodule"}


def assert_same_as_git(store: SaucerStore, name: str, source: Path) -> int:
    repo = store.repository(name)
    checked = 0
    for commit in all_commits(source):
        expected = files_at(source, commit)
        assert {e.path: (e.mode, e.oid) for e in repo.walk(commit)} == expected
        for path, (mode, _oid) in expected.items():
            if mode == "160000":
                with pytest.raises(NotAFile):
                    repo.read(commit, path)
                continue
            assert repo.read(commit, path) == show(source, commit, path), (commit, path)
            assert repo.entry(commit, path).kind == KINDS[mode]
            checked += 1
    return checked


def test_every_file_at_every_revision_equals_git_show(rich: Ingested) -> None:
    checked = assert_same_as_git(rich.store, "acme/demo", rich.source)
    assert checked > 60
    repo = rich.store.repository("acme/demo")
    main = git(rich.source, "rev-parse", "main").decode().strip()
    assert repo.read("main", NON_UTF8) == b"latin-1 name\n"
    assert repo.read("main", b"link-to-app") == b"src/app.py"  # a symlink reads as its target, like git show
    assert repo.entry("main", b"vendor/lib").kind == "submodule"
    assert len(repo.read("main", b"large/data.bin")) == 3 << 20
    assert repo.read(main, b"src/application.py") == repo.read("feature/rename", b"src/application.py")


def test_revisions_resolve_like_git(rich: Ingested) -> None:
    repo = rich.store.repository("acme/demo")

    def rev_parse(rev: str) -> str:
        return git(rich.source, "rev-parse", f"{rev}^{{commit}}").decode().strip()

    assert set(repo.branches()) == {"main", "feature/rename"}
    assert set(repo.tags()) == {"v0.1", "v1.0"}
    assert repo.head == "refs/heads/main"
    for rev in ["main", "HEAD", "v0.1", "v1.0", "feature/rename", "refs/tags/v1.0", "main~3", "v1.0~2^2",
                "v1.0^", rev_parse("main")[:7], rev_parse("v0.1")]:
        assert repo.resolve(rev) == rev_parse(rev), rev
    assert len(repo.commits()) == len(all_commits(rich.source))
    for bad in ["", "a" * 300, "main..v1", "../etc", "ma in", "x:y", "main@{1}", "/main"]:
        with pytest.raises(InvalidReference):
            repo.resolve(bad)
    for missing in ["nope", "deadbeef", "0" * 40, "v0.1~1", "main^3"]:
        with pytest.raises(RevisionNotFound):
            repo.resolve(missing)


def test_paths_are_validated_and_missing_ones_are_clear(rich: Ingested) -> None:
    repo = rich.store.repository("acme/demo")
    for bad in [b"../etc/passwd", b"src/../../x", b"a//b", b"./README.md", b"a\0b", b"x" * 5000]:
        with pytest.raises(InvalidReference):
            repo.read("main", bad)
    with pytest.raises(PathNotFound, match=re.escape("no 'src/nothing.py'")):
        repo.read("main", b"src/nothing.py")
    with pytest.raises(PathNotFound, match="not a directory"):
        repo.read("main", b"README.md/inner")
    with pytest.raises(NotAFile):
        repo.read("main", b"src")
    assert [e.name for e in repo.tree("main", b"src")] == [b"application.py", b"counter.txt"]
    with pytest.raises(RepositoryNotFound):
        rich.store.repository("acme/none")


def test_same_content_gives_byte_identical_artifacts(rich: Ingested, tmp_path: Path) -> None:
    # The same history, packed very differently at the source (a mirror, gc'd aggressively), into an empty store.
    mirror = tmp_path / "mirror.git"
    subprocess.run(["git", "clone", "-q", "--mirror", str(rich.source), str(mirror)], check=True)
    subprocess.run(["git", "-C", str(mirror), "gc", "-q", "--aggressive"], check=True)
    store = SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")
    event = ingest_into(store, tmp_path / "work", IngestRequest(name="acme/demo", location=f"file://{mirror}"))
    assert event.status == "ingested"
    assert event.manifest == rich.event.manifest
    first, second = rich.store.repository("acme/demo"), store.repository("acme/demo")
    for digest in (first.manifest.pack, first.manifest.idx, rich.event.manifest):
        assert digest is not None
        assert rich.store.blobs.get(digest) == store.blobs.get(digest)
    assert second.manifest.pack == first.manifest.pack


@pytest.mark.s3
def test_s3_store_holds_the_same_artifacts_and_serves_them(rich: Ingested, s3_settings: KilnSettings,
                                                           tmp_path: Path) -> None:
    blobs = S3BlobStore.from_settings(s3_settings, f"saucer-{uuid.uuid4().hex[:10]}")
    blobs.ensure_bucket()
    store = SaucerStore(blobs, tmp_path / "cache")
    event = ingest_into(store, tmp_path / "work", IngestRequest(name="acme/demo", location=str(rich.source)))
    assert event.manifest == rich.event.manifest
    assert store.names() == ["acme/demo"]
    # A second reader (another node) starts with an empty cache and downloads pack and index from S3.
    reader = SaucerStore(blobs, tmp_path / "other-node")
    assert assert_same_as_git(reader, "acme/demo", rich.source) > 60


def test_history_rewrites_are_served_like_any_repository(rich: Ingested, tmp_path: Path) -> None:
    store, source = rich.store, rich.store.repository("acme/demo")

    def derive(name: str, **rewrite: str) -> None:
        request = IngestRequest(name=name, rewrite=HistoryRewrite(source="acme/demo", **rewrite))  # type: ignore[arg-type]
        event = ingest_into(store, tmp_path, request)
        assert event.status == "ingested" and event.strategy == "rewrite", event

    derive("acme/demo-v01", operation="truncate", revision="v0.1")
    truncated = store.repository("acme/demo-v01")
    assert truncated.refs() == {"refs/heads/main": source.resolve("v0.1")}
    assert len(truncated.commits()) == 1

    derive("acme/demo-squashed", operation="squash", revision="main")
    squashed = store.repository("acme/demo-squashed")
    ((_, commit),) = squashed.commits()
    assert commit.parents == () and commit.tree == source.commit(source.resolve("main")).tree
    assert squashed.read("main", b"src/application.py") == source.read("main", b"src/application.py")

    derive("acme/demo-slim", operation="remove_path", path="large/data.bin")
    slim = store.repository("acme/demo-slim")
    assert len(slim.commits()) == len(source.commits())
    assert set(slim.branches()) == set(source.branches()) and set(slim.tags()) == set(source.tags())
    assert sorted((c.time, c.subject) for _, c in source.commits()) == sorted(
        (c.time, c.subject) for _, c in slim.commits())
    for new_id, _ in slim.commits():
        files = {e.path for e in slim.walk(new_id)}
        assert b"large/data.bin" not in files and b"large" not in {p.split(b"/")[0] for p in files}
    assert {e.path: e.oid for e in slim.walk("main")} == {
        e.path: e.oid for e in source.walk("main") if e.path != b"large/data.bin"}

    event = ingest_into(store, tmp_path, IngestRequest(name="acme/bad", rewrite=HistoryRewrite(
        source="acme/demo", operation="remove_path", path="never/there")))
    assert (event.status, event.reason) == ("failed", "bad_rewrite")
    event = ingest_into(store, tmp_path, IngestRequest(name="acme/bad", rewrite=HistoryRewrite(
        source="acme/missing", operation="squash", revision="main")))
    assert (event.status, event.reason) == ("failed", "source_missing")
