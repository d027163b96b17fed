"""``kiln saucer ...``: serve the store over HTTP, request ingestions and rewrites, list what is stored."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kiln.schemas.ingest import DEFAULT_REFS, HistoryRewrite, IngestEvent, IngestRequest
from kiln.streams.settings import get_settings

app = typer.Typer(help="Saucer: repository ingestion and serving.", no_args_is_help=True)
out = Console()


@app.command()
def serve(host: Annotated[str, typer.Option(help="Bind address: loopback unless a token protects the API.")] =
          "127.0.0.1", port: int = 8700, workers: int = 1,
          token: Annotated[str | None, typer.Option(envvar="KILN_SAUCER_TOKEN", help="Bearer token every API "
                                                    "request must present.")] = None) -> None:
    """Serve every stored repository over HTTP (FastAPI; /healthz, /metrics, /docs)."""
    import ipaddress

    import uvicorn

    from kiln.ingest.http import create_app
    from kiln.ingest.store import SaucerStore

    try:
        private = ipaddress.ip_address(host).is_loopback
    except ValueError:
        private = host == "localhost"
    if not private and not token:
        raise typer.BadParameter(f"serving on {host} needs a token (KILN_SAUCER_TOKEN): the API lists every "
                                 "repository and serves its files", param_hint="--host")
    uvicorn.run(create_app(SaucerStore.from_settings(get_settings()), token), host=host, port=port,
                workers=workers, log_level="warning")


def _submit(request: IngestRequest) -> None:
    from kiln.streams.client import KilnClient
    from kiln.workers.ingest.client import SaucerClient

    async def go() -> IngestEvent:
        async with KilnClient(get_settings()) as client:
            return await SaucerClient(client).ingest_repository(request)

    event = asyncio.run(go())
    out.print_json(event.model_dump_json())
    if event.status != "ingested":
        raise typer.Exit(1)


@app.command()
def ingest(name: str, location: str,
           refs: Annotated[list[str] | None, typer.Option("--ref", help="Ref glob; repeatable.")] = None) -> None:
    """Produce an ingestion request to repo.ingest and wait for its event."""
    _submit(IngestRequest(name=name, location=location, refs=refs or list(DEFAULT_REFS)))


@app.command()
def rewrite(name: str, source: str,
            truncate: Annotated[str | None, typer.Option(help="Keep history up to this revision.")] = None,
            squash: Annotated[str | None, typer.Option(help="One commit with this revision's tree.")] = None,
            remove_path: Annotated[str | None, typer.Option(help="Drop this path from every commit.")] = None) -> None:
    """Derive repository NAME from SOURCE by rewriting its history (exactly one operation)."""
    chosen = [(op, v) for op, v in (("truncate", truncate), ("squash", squash), ("remove_path", remove_path)) if v]
    if len(chosen) != 1:
        raise typer.BadParameter("give exactly one of --truncate, --squash, --remove-path")
    op, value = chosen[0]
    rw = HistoryRewrite(source=source, operation=op,
                        revision=value if op != "remove_path" else None,
                        path=value if op == "remove_path" else None)
    _submit(IngestRequest(name=name, rewrite=rw))


@app.command("ls")
def list_repos() -> None:
    """Repositories in the configured store."""
    from kiln.ingest.store import SaucerStore

    store = SaucerStore.from_settings(get_settings())
    table = Table("repository", "manifest", "ingested at", "location")
    for name in store.names():
        pointer = store.pointer(name)
        table.add_row(name, str(pointer["manifest"])[:19], str(pointer.get("ingested_at", "")),
                      str(pointer.get("location", "")))
    out.print(table)
