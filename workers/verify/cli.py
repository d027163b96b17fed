"""``kiln verify ...``: re-score stored verify requests with the verifiers installed here (``rescore``)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import typer
from rich.console import Console
from rich.table import Table

from kiln.streams.settings import get_settings

app = typer.Typer(help="The verify stage's tools: re-scoring stored requests.", no_args_is_help=True)
out = Console()


@app.callback()
def main() -> None:
    """The verify stage's tools (a group, so ``rescore`` stays a subcommand)."""


def _when(text: str | None) -> datetime | None:
    if text is None:
        return None
    when = datetime.fromisoformat(text)
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@app.command()
def rescore(
        since: str = typer.Option(None, help="ISO time (UTC unless given): requests the broker took from then on."),
        until: str = typer.Option(None, help="ISO time: requests taken until then."),
        from_offset: int = typer.Option(None, "--from", help="First offset, on every partition of verify.requests."),
        to_offset: int = typer.Option(None, "--to", help="Last offset (inclusive), on every partition."),
        concurrency: int = typer.Option(16, min=1, help="Requests re-checked at once."),
        publish: bool = typer.Option(True, help="Publish the new verdicts to verify.rescored."),
        json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """Re-check a range of stored verify requests with the verifiers installed here; publish the new verdicts to
    verify.rescored; report how many changed, from what to what, by verifier version."""
    from kiln.workers.verify.rescore import rescore as run

    report = asyncio.run(run(get_settings(), since=_when(since), until=_when(until), from_offset=from_offset,
                             to_offset=to_offset, concurrency=concurrency, publish=publish))
    if json:
        typer.echo(report.model_dump_json(indent=2))  # plain: a terminal's wrapping must not break the JSON
        return
    out.print(f"{report.topic}: {report.requests} requests, {report.completions} verdicts re-scored, "
              f"{report.changed} changed; {report.without_before} requests without a stored result, "
              f"{report.malformed} unreadable, {report.past_retention} offsets past retention; "
              f"{report.published} published")
    versions = Table("verifier old -> new version", "verdicts", title="re-scored, by verifier version")
    for key, n in report.versions.items():
        versions.add_row(key, str(n))
    out.print(versions)
    changes = Table("verifier", "old version", "new version", "from", "to", "verdicts", title="changed verdicts")
    for t in report.transitions:
        changes.add_row(t.verifier, t.old_version or "(none)", t.new_version, t.before, t.after, str(t.completions))
    out.print(changes)
