"""The gateway's FastAPI application: one ``KilnClient`` for the process, shared by every request of every API."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from kiln.integrations.gateway import kimina, online_judge, openrlhf, sandbox_fusion, swerex
from kiln.integrations.gateway.settings import GatewaySettings
from kiln.integrations.trainers.groups import GroupBaseline
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.exec.client import ExecClient
from kiln.workers.lean.client import LeanClient
from kiln.workers.verify.client import VerifySettings

REQUESTS = Counter("kiln_gateway_requests_total", "Gateway requests, by route and status code.", ["route", "code"])


def given_key(request: Request) -> str:
    """The API key a request carries: ``X-API-Key`` (SWE-ReX, kimina), ``Authorization: Bearer`` (kimina), or
    ``Authorization: Basic`` — what ``requests`` and ``aiohttp`` send for credentials in the URL
    (``http://kiln:KEY@GATEWAY:8500``): how SandboxFusion's client, which sets no headers, carries a key.
    In Basic credentials the key is the password, or the user name when there is no password."""
    if key := request.headers.get("x-api-key"):
        return key
    header = request.headers.get("authorization", "")
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip()
    if scheme.lower() == "basic":
        try:
            user, _, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return ""
        return password or user
    return header


def _authorized(request: Request) -> None:
    expected: str = request.app.state.settings.api_key
    if not expected:
        return
    if not hmac.compare_digest(given_key(request).encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong API key (KILN_GATEWAY_API_KEY)")


def create_app(settings: GatewaySettings, kiln_settings: KilnSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One client id per process: results of this gateway's jobs come back to it alone. The blob store
        # (KILN_BLOB_STORE) carries requests and results above KILN_CLAIM_CHECK_BYTES (a 200 KB run_code output).
        blobs = await asyncio.to_thread(open_blob_store, kiln_settings)
        async with KilnClient(kiln_settings, f"gateway.{socket.gethostname()}.{os.getpid()}",
                              blob_store=blobs) as kiln:
            app.state.kiln = kiln
            app.state.exec_client = ExecClient(kiln)
            app.state.lean_client = LeanClient(kiln)
            app.state.runtimes = swerex.Runtimes(app.state.exec_client, settings)
            app.state.groups = GroupBaseline(settings.openrlhf_group_size, VerifySettings().group_wait_s)
            yield

    app = FastAPI(title="kiln gateway", lifespan=lifespan)
    app.state.settings = settings
    for router in (sandbox_fusion.router, online_judge.router, kimina.router, swerex.router, openrlhf.router):
        app.include_router(router, dependencies=[Depends(_authorized)])

    @app.middleware("http")
    async def count(request: Request, call_next):  # type: ignore[no-untyped-def]
        response = await call_next(request)
        route = request.scope.get("route")
        REQUESTS.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
