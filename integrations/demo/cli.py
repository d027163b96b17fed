"""``kiln demo`` (contributed through the ``kiln.commands`` entry point): kiln's real job in miniature; ``kiln demo
basics``: the runtime's tour on the echo and sleep stages."""

from __future__ import annotations

import asyncio
import logging
import time

import typer
from rich.console import Console

from kiln.streams import admin
from kiln.streams.settings import get_settings

app = typer.Typer(help="Kiln's real job in miniature: repository -> image -> tests -> rewards -> learning.",
                  invoke_without_command=True)


@app.callback()
def story(ctx: typer.Context) -> None:
    """A repository shipped with kiln is ingested, built into an image and tested in an exec session; candidate
    patches are scored by its tests; a Lean snippet is proved (fake REPL); a short learning run shows accuracy
    rising on kiln's rewards. Ends with the report picture's path (settings: KILN_DEMO_*)."""
    if ctx.invoked_subcommand is not None:
        return
    from kiln.integrations.demo.story import tell

    settings = get_settings()
    console = Console()
    (settings.cache / "logs").mkdir(parents=True, exist_ok=True)  # kiln's own log lines: a file, not the terminal
    logging.basicConfig(filename=settings.cache / "logs" / "demo.log", level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    admin.wait_for_broker(settings)
    started = time.monotonic()
    console.print("[bold]kiln demo[/]: a repository becomes an image, its tests become rewards, a model learns "
                  f"from them [dim](Kafka client and worker logs: {settings.cache / 'logs'})[/]")
    picture = asyncio.run(tell(settings, console))
    console.print(f"[green]demo ok[/] in {time.monotonic() - started:.0f} s. The learning run's report picture: "
                  f"[bold]{picture}[/]")


@app.command()
def basics() -> None:
    """Run echo and sleep workers, submit a mix of jobs through the broker (a retry, a dead letter, a claim check),
    print results as they arrive."""
    from kiln.integrations.demo.basics import run_demo

    settings = get_settings()
    admin.wait_for_broker(settings)
    admin.create_topics(settings)
    if asyncio.run(run_demo(settings, Console())):
        raise typer.Exit(1)
