"""Saucer over HTTP (FastAPI): repositories, revisions, trees and files at any revision.

URLs: ``/repos/{name}/-/{revisions|tree|files}/{path}?rev=...``. The ``/-/`` separator is unambiguous because no
repository name has a ``-`` component. Paths are taken from the *raw* request path and percent-decoded to bytes,
so any git path (also non-UTF-8) is addressable; JSON carries paths percent-encoded (``urllib.parse.quote``).
Reads addressed by a full commit id are immutable and cached for a year; others revalidate by ETag (the blob or
tree id).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, Literal
from urllib.parse import quote, unquote, unquote_to_bytes

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.ingest.errors import InvalidReference, NotAFile, NotFound, SaucerError
from kiln.ingest.reader import MAX_PATH_BYTES, Repository, TreeEntry
from kiln.ingest.store import SaucerStore

IMMUTABLE = "public, max-age=31536000, immutable"
_SEP = b"/-/"


def encode_path(path: bytes) -> str:
    return quote(path, safe="/")


def _entry_json(entry: TreeEntry) -> dict[str, str]:
    return {"path": encode_path(entry.path), "name": encode_path(entry.name), "mode": entry.mode,
            "kind": entry.kind, "oid": entry.oid}


def _raw_path_after(request: Request, section: str) -> bytes:
    """The percent-decoded bytes of the path following ``/-/<section>`` in the raw request path."""
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
    _, _, rest = raw.partition(_SEP + section.encode())
    if len(rest) > 3 * MAX_PATH_BYTES:
        raise InvalidReference("path too long")
    return unquote_to_bytes(rest.lstrip(b"/"))


def _repo_name(request: Request) -> str:
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
    name, _, _ = raw.removeprefix(b"/repos/").partition(_SEP)
    return unquote(name.decode("ascii", errors="replace"))


def _caching(response: Response, rev: str, commit: str, etag: str) -> None:
    response.headers["ETag"] = f'"{etag}"'
    response.headers["X-Kiln-Commit"] = commit
    response.headers["Cache-Control"] = IMMUTABLE if rev == commit else "no-cache"


def _not_modified(request: Request, etag: str) -> bool:
    header = request.headers.get("if-none-match", "")
    return f'"{etag}"' in [t.strip().removeprefix("W/") for t in header.split(",")] or header.strip() == "*"


def _bearer_ok(scope: Scope, token: str) -> bool:
    headers = dict(scope.get("headers") or [])
    presented = headers.get(b"authorization", b"").decode(errors="replace").removeprefix("Bearer ").strip()
    return hmac.compare_digest(presented.encode(), token.encode())


def create_app(store: SaucerStore, token: str | None = None) -> FastAPI:
    """The app; with ``token``, every route but /healthz and /metrics needs ``Authorization: Bearer <token>``
    (repository names, locations and files are not for whoever can reach the port)."""
    app = FastAPI(title="kiln Saucer", description="Any file of any ingested repository at any revision.")
    registry = CollectorRegistry()
    served = Counter("kiln_saucer_requests_total", "HTTP requests, by route and status.", ["route", "status"],
                     registry=registry)
    latency = Histogram("kiln_saucer_request_seconds", "HTTP request latency.", ["route"], registry=registry,
                        buckets=(0.0005, 0.002, 0.01, 0.05, 0.2, 1, 5))

    @app.exception_handler(SaucerError)
    async def saucer_error(_request: Request, exc: SaucerError) -> JSONResponse:
        status = 404 if isinstance(exc, NotFound) else 409 if isinstance(exc, NotAFile) else (
            400 if isinstance(exc, InvalidReference) else 500)
        return JSONResponse({"detail": str(exc), "error": type(exc).__name__}, status_code=status)

    class Measure:
        """Plain ASGI middleware (Starlette's BaseHTTPMiddleware costs about a millisecond per request)."""

        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await self.inner(scope, receive, send)
                return
            started = time.perf_counter()
            status = [500]
            if token is not None and scope.get("path") not in ("/healthz", "/metrics") and not _bearer_ok(scope, token):
                await JSONResponse({"detail": "a bearer token is required"}, status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                served.labels("unauthorized", "401").inc()
                return

            async def sending(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await self.inner(scope, receive, sending)
            finally:
                name = getattr(scope.get("route"), "name", "unmatched")
                served.labels(name, str(status[0])).inc()
                latency.labels(name).observe(time.perf_counter() - started)

    app.add_middleware(Measure)

    async def open_repository(name: str) -> Repository:
        """Without I/O on the event loop: a pointer refresh or a first open (blob store reads, a pack download)
        runs in a thread; the common case, a fresh pointer to an open pack, does not pay the hop."""
        repo = store.opened(name)
        return repo if repo is not None else await asyncio.to_thread(store.repository, name)

    async def repository(request: Request) -> Repository:
        return await open_repository(_repo_name(request))

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "repositories": len(store.names())}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/repos")
    def list_repos() -> list[dict[str, Any]]:
        return [{"name": name, **store.pointer(name)} for name in store.names()]

    @app.get("/repos/{name:path}/-/revisions")
    async def revisions(request: Request, name: str,
                  kind: Literal["branches", "tags", "commits"] = "branches",
                  limit: int = Query(100, ge=1, le=10_000), offset: int = Query(0, ge=0)) -> dict[str, Any]:
        repo = await repository(request)
        if kind == "branches":
            items: list[dict[str, Any]] = [{"name": k, "commit": v} for k, v in sorted(repo.branches().items())]
        elif kind == "tags":
            items = [{"name": k, "commit": v} for k, v in sorted(repo.tags().items())]
        else:
            items = [{"commit": k, "tree": c.tree, "parents": list(c.parents), "time": c.time, "subject": c.subject}
                     for k, c in repo.commits()[offset:offset + limit]]
            return {"repository": repo.name, "kind": kind, "total": len(repo.manifest.commits), "items": items}
        return {"repository": repo.name, "kind": kind, "total": len(items), "items": items[offset:offset + limit]}

    @app.get("/repos/{name:path}/-/resolve")
    async def resolve(request: Request, name: str, rev: str = "HEAD") -> dict[str, str]:
        repo = await repository(request)
        return {"repository": repo.name, "rev": rev, "commit": repo.resolve(rev)}

    @app.get("/repos/{name:path}/-/tree/{path:path}")
    @app.get("/repos/{name:path}/-/tree")
    async def tree(request: Request, response: Response, name: str, path: str = "", rev: str = "HEAD") -> Any:
        repo = await repository(request)
        raw = _raw_path_after(request, "tree")
        commit = repo.resolve(rev)
        where = repo.entry(commit, raw)
        if _not_modified(request, where.oid):
            return Response(status_code=304, headers={"ETag": f'"{where.oid}"'})
        _caching(response, rev, commit, where.oid)
        return {"repository": repo.name, "commit": commit, "path": encode_path(where.path),
                "entries": [_entry_json(e) for e in repo.tree(commit, raw)]}

    @app.get("/repos/{name:path}/-/files/{path:path}")
    async def read_file(request: Request, name: str, path: str, rev: str = "HEAD") -> Response:
        repo = await repository(request)
        raw = _raw_path_after(request, "files")
        commit = repo.resolve(rev)
        entry = repo.entry(commit, raw)
        if entry.kind in ("directory", "submodule"):
            raise NotAFile(f"{encode_path(raw)} is a {entry.kind} at {commit[:12]}")
        if _not_modified(request, entry.oid):
            return Response(status_code=304, headers={"ETag": f'"{entry.oid}"'})
        response = Response(repo.blob(entry.oid), media_type="application/octet-stream",
                            headers={"X-Kiln-Mode": entry.mode, "X-Kiln-Kind": entry.kind})
        _caching(response, rev, commit, entry.oid)
        return response

    @app.get("/repos/{name:path}")
    async def describe(request: Request, name: str) -> dict[str, Any]:
        repo = await open_repository(unquote(name))
        return {"name": repo.name, "head": repo.head, "refs": repo.refs(), "commits": len(repo.manifest.commits),
                "objects": repo.manifest.objects, "pack_bytes": repo.manifest.pack_bytes,
                "manifest": repo.manifest_digest, **store.pointer(repo.name)}

    return app
