"""Saucer's HTTP API on a real uvicorn server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote, unquote_to_bytes

import httpx
import pytest

from kiln.ingest.http import IMMUTABLE, create_app
from tests.ingest.conftest import Ingested
from tests.ingest.gitrepos import NON_UTF8, all_commits, files_at, git, show
from tests.loopback import serving


@pytest.fixture(scope="module")
def saucer(rich: Ingested) -> Iterator[httpx.Client]:
    with serving(create_app(rich.store)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def file_url(path: bytes) -> str:
    return "/repos/acme/demo/-/files/" + quote(path, safe="/")


def test_every_file_at_every_revision_over_http(saucer: httpx.Client, rich: Ingested) -> None:
    for commit in all_commits(rich.source)[:4]:
        for path, (mode, oid) in files_at(rich.source, commit).items():
            r = saucer.get(file_url(path), params={"rev": commit})
            if mode == "160000":
                assert r.status_code == 409 and "submodule" in r.json()["detail"]
                continue
            assert r.status_code == 200, (path, r.text)
            assert r.content == show(rich.source, commit, path)
            assert r.headers["etag"] == f'"{oid}"' and r.headers["cache-control"] == IMMUTABLE


def test_revisions_trees_and_listing(saucer: httpx.Client, rich: Ingested) -> None:
    assert saucer.get("/healthz").json()["status"] == "ok"
    assert [r["name"] for r in saucer.get("/repos").json()] == ["acme/demo"]
    info = saucer.get("/repos/acme/demo").json()
    assert info["head"] == "refs/heads/main" and info["manifest"] == rich.event.manifest
    branches = saucer.get("/repos/acme/demo/-/revisions", params={"kind": "branches"}).json()["items"]
    assert {b["name"] for b in branches} == {"main", "feature/rename"}
    commits = saucer.get("/repos/acme/demo/-/revisions", params={"kind": "commits", "limit": 3}).json()
    assert commits["total"] == len(all_commits(rich.source)) and len(commits["items"]) == 3
    main = git(rich.source, "rev-parse", "main").decode().strip()
    assert saucer.get("/repos/acme/demo/-/resolve", params={"rev": main[:8]}).json()["commit"] == main

    root = saucer.get("/repos/acme/demo/-/tree", params={"rev": "main"})
    assert root.headers["cache-control"] == "no-cache"  # a branch moves: revalidate
    entries = {unquote_to_bytes(e["path"]): e["kind"] for e in root.json()["entries"]}
    assert entries[NON_UTF8] == "file" and entries[b"link-to-app"] == "symlink"
    assert entries[b"vendor"] == "directory" and entries[b"tools"] == "directory"
    sub = saucer.get("/repos/acme/demo/-/tree/tools", params={"rev": "main"}).json()["entries"]
    assert [(e["path"], e["kind"]) for e in sub] == [("tools/run.sh", "executable")]
    branch_file = saucer.get(file_url(b"src/application.py"), params={"rev": "feature/rename"})
    assert branch_file.status_code == 200


def test_non_utf8_paths_are_percent_encoded(saucer: httpx.Client) -> None:
    encoded = quote(NON_UTF8)
    assert "%E9" in encoded and "%FF" in encoded
    r = saucer.get(f"/repos/acme/demo/-/files/{encoded}", params={"rev": "main"})
    assert r.status_code == 200 and r.content == b"latin-1 name\n"


def test_etags_give_304(saucer: httpx.Client) -> None:
    first = saucer.get(file_url(b"README.md"), params={"rev": "main"})
    again = saucer.get(file_url(b"README.md"), params={"rev": "main"}, headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.content == b""


def test_errors_are_clear(saucer: httpx.Client) -> None:
    cases = [
        ("/repos/acme/nothing/-/files/README.md", 404, "no repository"),
        (file_url(b"README.md") + "?rev=nope", 404, "unknown revision"),
        (file_url(b"src/missing.py") + "?rev=main", 404, "no 'src/missing.py'"),
        ("/repos/acme/demo/-/files/%2E%2E/%2E%2E/etc/passwd?rev=main", 400, "not allowed"),
        ("/repos/acme/demo/-/files/src%00x?rev=main", 400, "NUL"),
        ("/repos/acme/demo/-/files/README.md?rev=" + "a" * 400, 400, "revision must be"),
        ("/repos/acme/demo/-/files/src?rev=main", 409, "directory"),
        ("/repos/acme/demo/-/files/" + "x/" * 3000 + "?rev=main", 400, "longer than 4096"),
    ]
    for url, status, words in cases:
        r = saucer.get(url)
        assert r.status_code == status, (url[:80], r.status_code, r.text[:200])
        assert words in r.json()["detail"], (url[:80], r.text[:200])


def test_metrics_count_requests(saucer: httpx.Client) -> None:
    saucer.get(file_url(b"README.md"), params={"rev": "main"})
    text = saucer.get("/metrics").text
    assert 'kiln_saucer_requests_total{route="read_file",status="200"}' in text
