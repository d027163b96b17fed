"""The ingest policy, tried as an attacker would: locations that read the worker's own files, reach into the
cluster (SSRF), use the worker's ssh identity or leak credentials through what Saucer stores and serves."""

from __future__ import annotations

import contextlib
import functools
import http.server
import ipaddress
import socket
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


NUMERIC_LOOPBACK = ("2130706433", "0x7f000001", "0x7F.0.0.1", "0177.0.0.1", "0177.0.0.01", "127.1", "127.0.1",
                    "127.000.000.001", "0", "0.0.0.0", "[::1]", "[0:0:0:0:0:0:0:1]", "[::ffff:127.0.0.1]",
                    "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:127.0.0.1]", "[::]", "[::127.0.0.1]", "[64:ff9b::127.0.0.1]",
                    "[2002:7f00:1::]", "LOCALHOST", "localhost.")


async def test_numeric_and_spelled_loopback_hosts_are_refused_and_never_contacted(
        store: SaucerStore, tmp_path: Path, served: tuple[int, list[str]]) -> None:
    """Every way of writing loopback that git (libcurl, getaddrinfo) accepts: decimal, hex, octal, short forms,
    IPv6 and IPv4-mapped; each names the live repository on loopback, so a policy that let one through would
    show up as a fetch."""
    port, hits = served
    for host in NUMERIC_LOOPBACK:
        for location in (f"http://{host}:{port}/repo.git", f"https://{TOKEN}@{host}:{port}/repo.git",
                         f"git://{host}:{port}/repo.git"):
            event = await _ingest(store, tmp_path, location, IngestPolicy())
            assert (event.status, event.reason) == ("failed", "invalid_location"), (location, event)
            assert TOKEN not in event.model_dump_json()
    assert hits == []


def _names_resolving_inward() -> list[str]:
    """Host names this machine resolves to loopback or a private address (``/etc/hosts``, its own name), besides
    ``localhost``: the offline stand-in for a public DNS name pointing inward."""
    names = {socket.gethostname()}
    with contextlib.suppress(OSError), open("/etc/hosts") as hosts:
        for line in hosts:
            names.update(line.split("#", 1)[0].split()[1:])
    found = []
    for name in sorted(names - {"localhost"}):
        with contextlib.suppress(OSError):
            addresses = {info[4][0] for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
            if any(ipaddress.ip_address(str(a).split("%")[0]).is_private for a in addresses):
                found.append(name)
    return found


async def test_names_resolving_inward_are_refused_and_never_contacted(
        store: SaucerStore, tmp_path: Path, served: tuple[int, list[str]]) -> None:
    port, hits = served
    names = _names_resolving_inward()
    if not names:
        pytest.skip("no host name here resolves inward besides localhost (/etc/hosts, the machine's own name)")
    for name in names:
        event = await _ingest(store, tmp_path, f"http://{name}:{port}/repo.git", IngestPolicy())
        assert (event.status, event.reason) == ("failed", "invalid_location"), (name, event)
        assert "internal address" in (event.detail or ""), event
    assert hits == []


@pytest.fixture
def redirector() -> Iterator[tuple[int, list[str], list[str]]]:
    """An allowed host (the operator's mirror, say) that answers every request with a 302 to another address;
    (its port, its request log, where to send the redirects)."""
    hits: list[str] = []
    targets: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(302)
            self.send_header("Location", targets[0] + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1]), hits, targets
    server.shutdown()
    server.server_close()


async def test_redirects_to_internal_addresses_are_not_followed(
        store: SaucerStore, tmp_path: Path, served: tuple[int, list[str]],
        redirector: tuple[int, list[str], list[str]]) -> None:
    """The allowed host is fetched from; its redirect to the internal repository (on loopback, under another
    port, never allowed) or to the metadata address is not followed: the internal service sees no request."""
    port, internal_hits = served
    mirror, mirror_hits, targets = redirector
    policy = IngestPolicy(allow_hosts=["localhost"])
    for target in (f"http://127.0.0.1:{port}", f"http://[::ffff:127.0.0.1]:{port}", f"http://2130706433:{port}",
                   "http://169.254.169.254/latest/meta-data"):
        targets[:] = [target]
        mirror_hits.clear()
        event = await _ingest(store, tmp_path, f"http://localhost:{mirror}/repo.git", policy)
        assert event.status == "failed" and event.reason != "invalid_location", (target, event)
        assert mirror_hits, "the allowed host was asked"
    assert internal_hits == []
    # The internal repository itself is fetchable when named and allowed: the redirect's target was live.
    allowed = await _ingest(store, tmp_path, f"http://127.0.0.1:{port}/repo.git",
                            IngestPolicy(allow_hosts=["127.0.0.1/32"]))
    assert allowed.status == "ingested" and internal_hits, allowed


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
