"""The ingest policy, tried as an attacker would: locations that read the worker's own files, reach into the
cluster (SSRF), use the worker's ssh identity or leak credentials through what Saucer stores and serves."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from kiln.ingest.cli import app as saucer_cli
from kiln.ingest.http import create_app
from kiln.ingest.policy import IngestPolicy, shown_form
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.streams.blobstore import FileBlobStore
from tests.ingest.gitrepos import Builder, git, write

TOKEN = "ghp_s3cretTokenValue"


@pytest.fixture
def store(tmp_path: Path) -> SaucerStore:
    return SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[int, list[str]]]:
    """A git repository over dumb HTTP on loopback (the kind of internal service SSRF aims at); its request log."""
    src = tmp_path / "src"
    b = Builder(src)
    write(src, "a.txt", "hello\n")
    b.commit("one")
    git(tmp_path, "clone", "--quiet", "--bare", str(src), str(tmp_path / "www" / "repo.git"))
    git(tmp_path / "www" / "repo.git", "update-server-info")
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            hits.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(tmp_path / "www")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1]), hits
    server.shutdown()
    server.server_close()


async def _ingest(store: SaucerStore, tmp_path: Path, location: str, policy: IngestPolicy) -> IngestEvent:
    return await ingest(IngestRequest(name="acme/x", location=location), "r", store, tmp_path / "work",
                        policy=policy)


async def test_local_paths_only_under_configured_roots(store: SaucerStore, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = tmp_path / "allowed"
    repo = Builder(allowed / "repo")
    write(allowed / "repo", "a", "1\n")
    repo.commit("c")
    outside = tmp_path / "private"
    private = Builder(outside)
    write(outside, "secret", "worker's own repository\n")
    private.commit("c")
    (allowed / "link").symlink_to(outside)  # a link inside a root that points out of it
    policy = IngestPolicy(local_roots=[allowed])
    assert (await _ingest(store, tmp_path, str(allowed / "repo"), policy)).status == "ingested"
    for location in (str(outside), f"file://{outside}", str(allowed / "link"), f"file://{allowed}/../private",
                     "/root", "/etc"):
        event = await _ingest(store, tmp_path, location, policy)
        assert (event.status, event.reason) == ("failed", "invalid_location"), (location, event)
        assert "KILN_INGEST_LOCAL_ROOTS" in (event.detail or "")
    monkeypatch.delenv("KILN_INGEST_LOCAL_ROOTS")  # the test session's own allowance
    nothing = await _ingest(store, tmp_path, str(allowed / "repo"), IngestPolicy())
    assert nothing.reason == "invalid_location"  # the default: no local path at all


async def test_internal_hosts_are_refused_and_never_contacted(store: SaucerStore, tmp_path: Path,
                                                              served: tuple[int, list[str]]) -> None:
    port, hits = served
    for location in (f"http://127.0.0.1:{port}/repo.git", f"http://localhost:{port}/repo.git",
                     f"http://[::1]:{port}/repo.git", f"https://{TOKEN}@127.0.0.1:{port}/repo.git",
                     "http://169.254.169.254/latest/meta-data", "http://10.1.2.3/repo.git",
                     f"http://[::ffff:127.0.0.1]:{port}/repo.git", "git://192.168.1.1/repo.git",
                     "http://0.0.0.0:9092/"):
        event = await _ingest(store, tmp_path, location, IngestPolicy())
        assert (event.status, event.reason) == ("failed", "invalid_location"), (location, event)
        assert TOKEN not in event.model_dump_json()
    assert hits == []


async def test_ssh_needs_kiln_key_never_the_workers(store: SaucerStore, tmp_path: Path) -> None:
    for location in ("git@example.invalid:acme/x.git", "ssh://git@example.invalid/acme/x.git"):
        event = await _ingest(store, tmp_path, location, IngestPolicy())
        assert event.reason == "invalid_location" and "KILN_INGEST_SSH_KEY" in (event.detail or ""), event


async def test_credentials_are_used_but_never_stored_or_served(store: SaucerStore, tmp_path: Path,
                                                               served: tuple[int, list[str]]) -> None:
    port, hits = served
    policy = IngestPolicy(allow_hosts=["127.0.0.1/32"])
    event = await _ingest(store, tmp_path, f"http://user:{TOKEN}@127.0.0.1:{port}/repo.git", policy)
    assert event.status == "ingested", event
    assert hits, "the allowed host was fetched from"
    assert event.location == f"http://127.0.0.1:{port}/repo.git"
    listing = TestClient(create_app(store)).get("/repos")
    assert listing.status_code == 200 and "acme/x" in listing.text and TOKEN not in listing.text
    assert TOKEN not in TestClient(create_app(store)).get("/repos/acme/x").text
    missing = await _ingest(store, tmp_path, f"http://x-access-token:{TOKEN}@127.0.0.1:{port}/none.git?auth={TOKEN}",
                            policy)
    assert missing.status == "failed" and TOKEN not in missing.model_dump_json(), missing


def test_pins_are_bounded() -> None:
    with pytest.raises(ValidationError):
        IngestRequest(name="acme/x", location="https://example.org/x.git",
                      pin={f"refs/tags/t{i}": "0" * 40 for i in range(5000)})


@given(scheme=st.sampled_from(["http", "https", "git", "ssh", "file"]), user=st.text("abcxyz_-.", min_size=1,
       max_size=12), secret=st.text("QWERTZ789~", min_size=8, max_size=24),
       host=st.sampled_from(["example.org", "10.0.0.1", "[::1]", "h:8080"]), path=st.text("abc/._-", max_size=20))
def test_shown_form_never_carries_a_password_query_or_fragment(scheme: str, user: str, secret: str, host: str,
                                                                path: str) -> None:
    shown = shown_form(f"{scheme}://{user}:{secret}@{host}/{path}?token={secret}#{secret}")
    assert secret not in shown and "?" not in shown and "#" not in shown


def test_saucer_api_needs_its_token_and_binds_publicly_only_with_one(store: SaucerStore) -> None:
    api = TestClient(create_app(store, token=TOKEN))
    assert api.get("/repos").status_code == 401
    assert api.get("/repos", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert api.get("/repos", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert api.get("/healthz").status_code == 200  # probes and metrics stay open (they reveal no repository)
    refused = CliRunner().invoke(saucer_cli, ["serve", "--host", "0.0.0.0"], env={"KILN_SAUCER_TOKEN": ""})
    assert refused.exit_code != 0 and "needs a token" in refused.output
