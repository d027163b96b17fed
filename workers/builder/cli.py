"""``kiln builds ...``: request builds and read the failure taxonomy off ``image.events``."""

from __future__ import annotations

import asyncio
from collections import Counter

import typer
from rich.console import Console
from rich.table import Table

from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.streams.replay import read_topic
from kiln.streams.settings import get_settings

app = typer.Typer(help="Image builds: submit, and the failure table.", no_args_is_help=True)
out = Console()


@app.command()
def submit(repository: str, revision: str = "HEAD", force: bool = False) -> None:
    """Produce a build request to image.build and wait for its event."""
    from kiln.streams.client import KilnClient
    from kiln.workers.builder.client import BuilderClient

    async def go() -> BuildEvent:
        async with KilnClient(get_settings()) as client:
            return await BuilderClient(client).build(BuildRequest(repository=repository, revision=revision,
                                                                  force=force))

    event = asyncio.run(go())
    out.print_json(event.model_dump_json(exclude={"tests": {"coverage": {"files"}}}))
    if not event.usable:
        raise typer.Exit(1)


@app.command()
def failures() -> None:
    """Failed builds by build system and failure class, from every event on image.events."""
    counts: Counter[tuple[str, str]] = Counter()
    totals: Counter[str] = Counter()
    for record in read_topic(get_settings(), "image.events"):
        try:
            event = BuildEvent.model_validate_json(record.value() or b"")
        except ValueError:
            continue
        if event.cached:
            continue
        system = event.system or "unknown"
        totals[system] += 1
        if event.failure:
            counts[(system, event.failure)] += 1
    table = Table("build system", "failure class", "failed", "of builds", title="build failures")
    for (system, reason), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(system, reason, str(n), str(totals[system]))
    out.print(table)
