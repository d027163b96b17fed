"""``kiln gateway serve``: the peers' HTTP APIs over kiln (settings ``KILN_GATEWAY_*``)."""

from __future__ import annotations

import typer
import uvicorn

app = typer.Typer(help="HTTP APIs of the tools trainers use (SandboxFusion, kimina-lean-server, SWE-ReX).",
                  no_args_is_help=True)


@app.command()
def serve(port: int | None = None, host: str | None = None) -> None:
    """Serve the gateway; SIGTERM stops it after the requests in flight are answered (uvicorn's graceful
    shutdown)."""
    from kiln.integrations.gateway.app import create_app
    from kiln.integrations.gateway.settings import GatewaySettings
    from kiln.streams.settings import get_settings

    settings = GatewaySettings()
    if port is not None:
        settings.port = port
    if host is not None:
        settings.host = host
    uvicorn.run(create_app(settings, get_settings()), host=settings.host, port=settings.port, log_level="warning")
