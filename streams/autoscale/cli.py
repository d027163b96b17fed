"""``kiln autoscale run STAGE...``: the autoscaler process (SIGTERM stops it; the local backend then stops its
workers gracefully)."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="The autoscaler of Harmonic's REPL service, over the stats stream.", no_args_is_help=True)


@app.command()
def run(
    stages: Annotated[list[str], typer.Argument(help="Stages to scale.")],
    backend: Annotated[str, typer.Option(help="'local' (worker processes here) or 'keda' (serve /keda/<stage>).")]
    = "local",
    stats_url: Annotated[str, typer.Option(envvar="KILN_AUTOSCALE_STATS_URL", help="The stats app.")]
    = "http://127.0.0.1:8600",
    tick_s: Annotated[float, typer.Option(help="Seconds between decisions (Harmonic's REPL service: 60).")] = 60.0,
    goal_minutes: Annotated[float, typer.Option(help="Cm: minutes to clear a queue.")] = 5.0,
    min_workers: Annotated[int, typer.Option("--min")] = 1,
    max_workers: Annotated[int, typer.Option("--max")] = 100,
    slots: Annotated[int, typer.Option(help="Slots of each worker the local backend starts (and the size a "
                                            "Kubernetes pod brings).")] = 1,
    job_seconds_guess: Annotated[float, typer.Option(help="Job time assumed before any has finished.")] = 60.0,
    slots_of: Annotated[list[str] | None, typer.Option(help="STAGE=N: that stage's workers bring N slots "
                                                           "(repeatable; default --slots).")] = None,
    down_ticks: Annotated[int, typer.Option(help="Ticks that all want fewer workers before scaling down.")] = 3,
    worker_arg: Annotated[list[str] | None, typer.Option(help="Extra argument of each local worker (repeatable), "
                                                              "e.g. --worker-arg=--topic=x.")] = None,
    log_dir: Annotated[Path, typer.Option(help="Local workers' logs.")] = Path("autoscale-workers"),
    decision_log: Annotated[Path | None, typer.Option(help="Append each decision as a JSON line.")] = None,
    port: Annotated[int, typer.Option(envvar="KILN_AUTOSCALE_PORT", help="/keda/<stage>, /metrics, /healthz.")]
    = 8800,
    host: Annotated[str, typer.Option(envvar="KILN_AUTOSCALE_HOST")] = "127.0.0.1",
) -> None:
    """Every tick, per stage: Lq, Rmin, Bmin from the stats stream -> the rule's minimum -> the backend."""
    from kiln.streams.autoscale.backends import Backend, KedaBackend, LocalBackend
    from kiln.streams.autoscale.decide import Policy
    from kiln.streams.autoscale.loop import Autoscaler
    from kiln.streams.metrics import health_route, serve_routes
    from kiln.streams.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one request per stage and tick
    if backend not in ("local", "keda"):
        raise typer.BadParameter("--backend is 'local' or 'keda'")
    chosen: Backend = (LocalBackend(slots, worker_arg or [], log_dir, get_settings().grace_s) if backend == "local"
                       else KedaBackend())
    policy = Policy(goal_minutes=goal_minutes, min_workers=min_workers, max_workers=max_workers,
                    slots_per_worker=slots, job_seconds_guess=job_seconds_guess, busy_trigger=backend == "local",
                    down_ticks=down_ticks)
    sizes = {}
    for item in slots_of or []:
        stage, _, n = item.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise typer.BadParameter(f"--slots-of {item!r}: expected STAGE=N with N >= 1")
        sizes[stage] = int(n)
    scaler = Autoscaler(stages, policy, chosen, stats_url, decision_log, sizes)
    stop = threading.Event()

    def health() -> dict[str, Any]:
        return {"status": "ok", "stages": {s: d.model_dump() for s, d in scaler.latest.items()}}

    server = serve_routes(host, port, {"/keda/": scaler.keda, "/metrics": scaler.metrics,
                                       "/healthz": health_route(health)})
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        scaler.run(tick_s, stop)
    finally:
        server.shutdown()


@app.command()
def check(decision_log: Annotated[Path, typer.Argument(help="A log written by --decision-log.")]) -> None:
    """Recompute every logged decision from its logged inputs; exit 1 on any that does not follow."""
    import json

    from kiln.streams.autoscale.loop import Autoscaler

    entries = [json.loads(line) for line in decision_log.read_text().splitlines() if line.strip()]
    problems = Autoscaler.audit(entries)
    for problem in problems:
        typer.echo(problem)
    typer.echo(f"{len(entries)} decisions, {len(problems)} that do not follow from their inputs")
    if problems:
        raise typer.Exit(1)
