"""``kiln stats serve``: run the stats stream (one process; SIGTERM stops it gracefully)."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(help="The stats stream: per-stage numbers in kiln.stats and over HTTP.", no_args_is_help=True)


@app.command()
def serve(verbose: Annotated[bool, typer.Option(help="Faust's info log.")] = False) -> None:
    """Aggregate results, dead letters and heartbeats; publish to kiln.stats; serve /stats on KILN_STATS_PORT."""
    import faust

    from kiln.streams.settings import get_settings
    from kiln.streams.stats.app import StatsApp, StatsSettings

    stats = StatsApp(get_settings(), StatsSettings())
    stats.declare_topics()
    faust.Worker(stats.app, loglevel="info" if verbose else "warning", quiet=True).execute_from_commandline()
