"""``kiln status [--watch] | serve``, ``kiln tail TOPIC`` (a plain command), ``kiln dlq ls|show|redrive``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kiln.streams.errors import KilnError
from kiln.streams.settings import get_settings
from kiln.streams.stage import STATS_TOPIC
from kiln.streams.status.view import OpsView

KEEP_UP_MINUTES = 5.0
"""Cm, the autoscaler's default: a stage whose queue takes longer to drain is shown behind (as on the page)."""

status_app = typer.Typer(help="Per-stage numbers from the stats stream, as a table or a web page.",
                         invoke_without_command=True)
dlq_app = typer.Typer(help="Dead letters: list by reason, show one, re-drive to the source topic.",
                      no_args_is_help=True)
console = Console()


def _status_table(view: OpsView) -> Table:
    table = Table(title=f"kiln status · {len(view.alive())} workers alive")
    for column in ("stage", "queue", "done/min", "busy/slots", "workers", "p50 / p99 s", "failures/min", "DLQ",
                   "done", "keeping up"):
        table.add_column(column, justify="left" if column in ("stage", "keeping up", "failures/min") else "right")

    def q(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"
    for stage, s in sorted(view.stats.items()):
        queue, rate = s.queue_length, s.completions_per_min
        if queue and (rate <= 0 or queue / rate > KEEP_UP_MINUTES):
            verdict = "[red]stuck[/]" if rate <= 0 else f"[red]behind: {queue / rate:.1f} min[/]"
        else:
            verdict = "[green]yes[/]" if s.workers_now or not queue else "[dim]idle[/]"
        failures = ", ".join(f"{k} {v:.1f}" for k, v in s.failures_per_min.items())
        table.add_row(stage, q(queue), f"{rate:.1f}", f"{s.busy_now}/{s.slots_now}", str(s.workers_now),
                      f"{q(s.job_seconds_p50)} / {q(s.job_seconds_p99)}", failures or "-",
                      str(s.dead_letters_total), str(s.completions_total), verdict)
    return table


def _task_table(view: OpsView) -> Table | None:
    sources = view.task_sources()
    if not sources:
        return None
    table = Table(title="task health (kiln tasks health)")
    for column in ("task source", "tasks", "healthy", "quarantined", "unchecked", "healthy share",
                   "quarantined by reason", "kiln failures"):
        table.add_column(column, justify="left" if column in ("task source", "quarantined by reason") else "right")
    for source, t in sources.items():
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(t["reasons"].items())) or "-"
        table.add_row(source, str(t["tasks"]), str(t["healthy"]), str(t["quarantined"]), str(t["unchecked"]),
                      f"{t['healthy_share']:.0%}", reasons, str(t["kiln_failures"]))
    return table


@status_app.callback()
def status(ctx: typer.Context,
           watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw every --every seconds.")] = False,
           every: Annotated[float, typer.Option(help="Seconds between redraws with --watch.")] = 2.0,
           svg: Annotated[Path | None, typer.Option(help="Also save the table as an SVG screenshot.")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="The page's JSON instead of a table.")] = False,
           ) -> None:
    """The status page's numbers as tables (read from kiln.stats, kiln.heartbeats and kiln.tasks.health)."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.live import Live

    view = OpsView(get_settings()).start()
    try:
        view.caught_up.wait(30)
        if as_json:
            print(json.dumps(view.snapshot(), indent=1))
            return
        if not watch:
            recorder = Console(record=True, width=160)
            recorder.print(_status_table(view))
            tasks = _task_table(view)
            if tasks is not None:
                recorder.print(tasks)
            if not view.stats:
                recorder.print(f"no numbers on {view.settings.topic(STATS_TOPIC)}: is `kiln stats serve` running?")
            if svg is not None:
                recorder.save_svg(str(svg), title="kiln status")
            return
        with Live(_status_table(view), console=console, refresh_per_second=1) as live:
            while True:
                time.sleep(every)
                live.update(_status_table(view))
    except KeyboardInterrupt:
        pass
    finally:
        view.stop()


@status_app.command()
def serve() -> None:
    """Serve the status page on KILN_STATUS_HOST:KILN_STATUS_PORT (SIGTERM stops it gracefully)."""
    import uvicorn

    from kiln.streams.status.server import StatusSettings, create_app

    settings = StatusSettings()
    uvicorn.run(create_app(get_settings(), settings), host=settings.host, port=settings.port, log_level="warning")


def tail(topic: Annotated[str, typer.Argument(help="Topic name without the deployment's prefix.")],
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new records.")] = False,
         last: Annotated[int, typer.Option("--last", "-n", help="Records before each partition's end.")] = 10,
         from_beginning: Annotated[bool, typer.Option(help="From each partition's start.")] = False,
         kind: Annotated[str | None, typer.Option(help="Only this stage's records.")] = None,
         client: Annotated[str | None, typer.Option(help="Only this client id's records.")] = None,
         request_id: Annotated[str | None, typer.Option(help="Only this request (or what re-drives it).")] = None,
         as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False) -> None:
    """Print the records of TOPIC decoded (requests, results, dead letters, heartbeats, stats, task health)."""
    from kiln.streams.status.tail import Filter
    from kiln.streams.status.tail import tail as follow_topic

    try:
        for record in follow_topic(get_settings(), topic, last=last, from_beginning=from_beginning, follow=follow,
                                   keep=Filter(kind, client, request_id)):
            if as_json:
                print(json.dumps(record.as_json()), flush=True)
            else:
                console.print(f"[dim]{record.partition}:{record.offset}[/] {record.summary()}", markup=True,
                              highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        pass
    except KilnError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1) from None


def _topics(stage: list[str] | None, topic: str | None) -> list[str]:
    from kiln.streams.status.dlq import dlq_topics

    return [topic] if topic else dlq_topics(get_settings(), stage)


StageOption = Annotated[list[str] | None, typer.Option("--stage", help="Only these stages' DLQs (default all).")]
TopicOption = Annotated[str | None, typer.Option(help="A dead-letter topic by name (e.g. a custom worker topic's).")]


@dlq_app.command("ls")
def list_dead_letters(stage: StageOption = None, topic: TopicOption = None,
                      records: Annotated[bool, typer.Option("--records", help="One line per record.")] = False) -> None:
    """Dead letters per topic, counted by reason (and whether re-driven)."""
    from kiln.streams.status.dlq import dead_letters, marker_key, redriven

    settings = get_settings()
    done = redriven(settings)
    table = Table(title="dead letters")
    for column in ("topic", "reason", "count", "re-driven"):
        table.add_column(column, justify="right" if column in ("count", "re-driven") else "left")
    for name in _topics(stage, topic):
        found = dead_letters(settings, name)
        by_reason: dict[str, list[str]] = {}
        for r in found:
            by_reason.setdefault(r.fields.get("reason", "?"), []).append(marker_key(r))
            if records:
                mark = f" [green]re-driven as {done[marker_key(r)]['request_id']}[/]" if marker_key(r) in done else ""
                console.print(f"{name} @{r.offset} {r.summary()}{mark}", highlight=False)
        for reason, keys in sorted(by_reason.items()):
            table.add_row(name, reason, str(len(keys)), str(sum(k in done for k in keys)))
    console.print(table)


@dlq_app.command("show")
def show(offset: Annotated[int, typer.Argument(help="The dead letter's offset (DLQ topics have one partition).")],
         stage: Annotated[str | None, typer.Option(help="The stage whose DLQ holds it.")] = None,
         topic: TopicOption = None) -> None:
    """One dead letter: its headers and its payload."""
    from kiln.streams.status.dlq import dead_letters

    names = _topics([stage] if stage else None, topic)
    if len(names) != 1:
        raise typer.BadParameter("name the DLQ with --stage or --topic")
    found = [r for r in dead_letters(get_settings(), names[0]) if r.offset == offset]
    if not found:
        console.print(f"[red]no record at offset {offset} of {names[0]}[/]")
        raise typer.Exit(1)
    record = found[0]
    table = Table(title=f"{names[0]} @{offset}", show_header=False)
    for key, value in record.headers:
        table.add_row(key, value)
    console.print(table)
    print(json.dumps(record.as_json()["value"], indent=1))


@dlq_app.command("redrive")
def redrive(stage: Annotated[str | None, typer.Option(help="The stage whose DLQ to re-drive from.")] = None,
            topic: TopicOption = None,
            offset: Annotated[list[int] | None, typer.Option(help="Only these offsets.")] = None,
            reason: Annotated[list[str] | None, typer.Option(help="Only dead letters of these reasons.")] = None,
            request_id: Annotated[list[str] | None, typer.Option(help="Only these original request ids.")] = None,
            all_: Annotated[bool, typer.Option("--all", help="Every dead letter of the topic.")] = False,
            dry_run: Annotated[bool, typer.Option(help="Say what would be re-driven.")] = False) -> None:
    """Send selected dead letters back to their source topic under new request ids (redriven_from = the
    original); each dead letter is re-driven at most once."""
    from kiln.streams.blobstore import open_blob_store
    from kiln.streams.status import dlq

    names = _topics([stage] if stage else None, topic)
    if len(names) != 1:
        raise typer.BadParameter("name the DLQ with --stage or --topic")
    if not (offset or reason or request_id or all_):
        raise typer.BadParameter("select dead letters: --offset, --reason, --request-id or --all")
    settings = get_settings()
    chosen = dlq.select(dlq.dead_letters(settings, names[0]), offsets=offset, reasons=reason, request_ids=request_id)
    if dry_run:
        for r in chosen:
            console.print(f"would re-drive @{r.offset} {r.summary()}", highlight=False)
        return
    outcomes = dlq.redrive(settings, names[0], chosen, open_blob_store(settings))
    for o in outcomes:
        what = f"[yellow]skipped: {o.skipped}[/]" if o.skipped else f"[green]{o.original} -> {o.request_id}[/]"
        console.print(f"{o.dead_letter} {what}", highlight=False)
    sent = sum(o.skipped is None for o in outcomes)
    console.print(f"re-drove {sent} of {len(outcomes)} selected")
