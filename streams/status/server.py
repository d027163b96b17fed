"""The status page: FastAPI serving one static HTML page and its script (no build step), which poll
``/api/status`` (``OpsView.snapshot``) and draw tables and sparklines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.streams.settings import KilnSettings
from kiln.streams.status.view import OpsView

STATIC = Path(__file__).with_name("static")


class StatusSettings(BaseSettings):
    """The status page's knobs (``KILN_STATUS_`` + field name); Kafka and topics come from ``KilnSettings``."""

    model_config = SettingsConfigDict(env_prefix="KILN_STATUS_", extra="ignore")

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8650, description="HTTP port: / (the page), /api/status, /healthz, /metrics.")
    refresh_s: float = Field(2.0, gt=0, description="How often the page polls /api/status.")


def create_app(settings: KilnSettings, status: StatusSettings) -> FastAPI:
    view = OpsView(settings)
    registry = CollectorRegistry()
    stages_shown = Gauge("kiln_status_stages", "Stages with numbers on the page.", registry=registry)
    caught_up = Gauge("kiln_status_caught_up", "1 once the topics the page follows were read to their end.",
                      registry=registry)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        view.start()
        try:
            yield
        finally:
            view.stop()

    app = FastAPI(title="kiln status", lifespan=lifespan)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/status")
    def snapshot() -> dict[str, Any]:
        return {**view.snapshot(), "refresh_s": status.refresh_s, "prefix": settings.topic_prefix}

    @app.get("/healthz")
    def health() -> JSONResponse:
        ready = view.caught_up.is_set()
        return JSONResponse({"status": "ok" if ready else "starting"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        stages_shown.set(len(view.stats))
        caught_up.set(1 if view.caught_up.is_set() else 0)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
