"""The ``kiln`` command line: local infrastructure, topics, workers, replay and the demo."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from kiln.streams import admin, console
from kiln.streams.errors import InfraError, KilnError, MissingExtra
from kiln.streams.extras import missing_extra
from kiln.streams.infra import COMPONENT_STEPS, run_script, run_steps
from kiln.streams.settings import get_settings
from kiln.streams.stage import spec_for_topic, stage_specs, topology

app = typer.Typer(no_args_is_help=True, help="kiln: execution feedback for RL training, on Kafka.")
out = Console()


@app.callback()
def _options(
    verbose: Annotated[bool, typer.Option("--verbose", help="Show librdkafka's own log lines on the terminal too "
                                                            "(always in $KILN_CACHE/logs/kiln.log).")] = False,
) -> None:
    """kiln: execution feedback for RL training, on Kafka."""

ALL_COMPONENTS = ["kafka", "docker", "s3", "registry", "lean", "ops", "compose", "trainers"]


def _service(component: str, script: str) -> typer.Typer:
    sub = typer.Typer(help=f"Manage the local {component} on loopback.", no_args_is_help=True)

    @sub.command()
    def start() -> None:
        """Install if needed and start (idempotent); waits until ready."""
        run_steps(COMPONENT_STEPS[component])

    @sub.command()
    def stop() -> None:
        """Stop it (idempotent)."""
        run_script(script, "stop")

    @sub.command()
    def status() -> None:
        """Exit 0 when running and answering."""
        try:
            out.print(run_script(script, "status").strip())
        except KilnError as e:
            out.print(str(e).splitlines()[-1])
            raise typer.Exit(1) from None

    return sub


app.add_typer(_service("kafka", "kafka/kafka.sh"), name="broker")
app.add_typer(_service("s3", "s3/s3.sh"), name="s3")
app.add_typer(_service("registry", "registry/registry.sh"), name="registry")
app.add_typer(_service("docker", "docker/docker.sh"), name="docker")


@app.command()
def setup(
    components: Annotated[list[str] | None, typer.Argument(help=f"Any of {ALL_COMPONENTS}; default kafka.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Everything the tests need.")] = False,
) -> None:
    """Install and start local components (cached outside the repo), then create the stage topics."""
    chosen = ALL_COMPONENTS if all_ else (components or ["kafka"])
    unknown = set(chosen) - set(ALL_COMPONENTS)
    if unknown:
        raise typer.BadParameter(f"unknown components {sorted(unknown)}")
    run_steps([step for c in ALL_COMPONENTS if c in chosen for step in COMPONENT_STEPS[c]])
    if "kafka" in chosen:
        _create_topics()


topics = typer.Typer(help="Stage topics.", no_args_is_help=True)
app.add_typer(topics, name="topics")


UNSAFE = Annotated[bool, typer.Option("--allow-unsafe-replication", help="On a cluster of several brokers, create "
                                       "topics with replication 1 or min.insync.replicas 1 anyway.")]


def _create_topics(allow_unsafe: bool = False) -> None:
    settings = get_settings()
    if allow_unsafe:
        settings = settings.model_copy(update={"allow_unsafe_topics": True})
    admin.wait_for_broker(settings)
    durability = admin.cluster_durability(settings)
    result = admin.create_topics(settings)
    created = sum(1 for v in result.values() if v == "created")
    out.print(f"topics: {created} created, {len(result) - created} already present (replication "
              f"{durability.replication}, min.insync.replicas {durability.min_insync_replicas}, "
              f"{durability.brokers} broker{'s' if durability.brokers > 1 else ''})")


@app.command()
def init(
    bucket: Annotated[list[str] | None, typer.Option(help="Extra S3 buckets to create (e.g. the registry's).")] = None,
    allow_unsafe: UNSAFE = False,
) -> None:
    """Create the stage topics, the blob store (bucket) and extra buckets: a deployment's one-shot setup."""
    from kiln.streams.blobstore import S3BlobStore, open_blob_store

    _create_topics(allow_unsafe)
    settings = get_settings()
    open_blob_store(settings)
    for name in bucket or []:
        S3BlobStore.from_settings(settings, name).ensure_bucket()
    out.print(f"blob store ready: {settings.blob_store or 'file store under ' + str(settings.cache)}")


@topics.command("create")
def topics_create(allow_unsafe: UNSAFE = False) -> None:
    """Create every stage's request, result and DLQ topics with their partition counts and configs, replicated as
    the cluster's defaults say (KILN_TOPIC_REPLICATION / KILN_TOPIC_MIN_INSYNC_REPLICAS override them)."""
    _create_topics(allow_unsafe)


@topics.command("list")
def topics_list() -> None:
    """Show the topology kiln expects and what the broker has."""
    settings = get_settings()
    md = admin.admin_client(settings).list_topics(timeout=15)
    table = Table("topic", "partitions (spec)", "partitions (broker)", "config")
    for spec in topology():
        name = settings.topic(spec.name)
        have = md.topics.get(name)
        table.add_row(name, str(spec.partitions), str(len(have.partitions)) if have else "-",
                      ", ".join(f"{k}={v}" for k, v in spec.config.items()))
    out.print(table)


def _logging(verbose: bool) -> None:
    import logging

    from rich.logging import RichHandler

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_path=False)])
    # httpx logs every request at INFO: a rollout worker spent 13% of its CPU writing those lines (py-spy).
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)
    console.route_kafka_logs(get_settings(), verbose)


@app.command()
def worker(
    stage: Annotated[str, typer.Argument(help="Stage name (entry point in group kiln.stages).")],
    slots: Annotated[int, typer.Option(help="Job slots; 0 = KILN_SLOTS or the CPU count.")] = 0,
    group: Annotated[str | None, typer.Option(help="Consumer group; default kiln.<stage>.")] = None,
    topic: Annotated[str | None, typer.Option(help="Request topic; default the stage's.")] = None,
    per_partition: Annotated[int | None, typer.Option(help="Max jobs in flight per partition (fairness).")] = None,
    mode: Annotated[str, typer.Option(help="'group' (consumer group, any broker) or 'queue' (Kafka share group, "
                                           "short jobs only).")] = "group",
    verbose: bool = False,
) -> None:
    """Run a stage worker until SIGTERM: metrics and /healthz on KILN_METRICS_PORT."""
    import asyncio

    from kiln.streams.blobstore import open_blob_store
    from kiln.streams.runtime import Worker
    from kiln.streams.share import ShareWorker
    from kiln.streams.stage import load_stage

    _logging(verbose)
    settings = get_settings()
    if mode not in ("group", "queue"):
        raise typer.BadParameter("--mode is 'group' or 'queue'")
    runner: Worker | ShareWorker
    if mode == "queue":
        runner = ShareWorker(load_stage(stage), settings, slots=slots or None, group_id=group, topic=topic,
                             blob_store=open_blob_store(settings))
    else:
        runner = Worker(load_stage(stage), settings, slots=slots or None, group_id=group, topic=topic,
                        max_in_flight_per_partition=per_partition, blob_store=open_blob_store(settings))
    asyncio.run(runner.run(install_signal_handlers=True))
    if runner.failure:
        out.print(f"[red]worker failed:[/] {runner.failure}")
        raise typer.Exit(3)


@app.command()
def replay(
    topic: Annotated[str, typer.Argument(help="Request topic, e.g. repo.ingest (KILN_TOPIC_PREFIX is added).")],
    from_beginning: Annotated[bool, typer.Option("--from-beginning", help="Start at offset 0 (required).")] = False,
    stage: Annotated[str | None, typer.Option(help="Stage whose handler consumes it; default: by topic.")] = None,
    concurrency: int = 8,
) -> None:
    """Feed a topic from offset 0 through a stage's handler, with progress, re-emitting no results."""
    import asyncio

    from kiln.streams.blobstore import open_blob_store
    from kiln.streams.replay import replay as run_replay
    from kiln.streams.stage import load_stage

    if not from_beginning:
        raise typer.BadParameter("only --from-beginning replays are supported")
    settings = get_settings()
    consumer = spec_for_topic(topic)
    name = stage or (consumer.kind if consumer else None)
    if name is None:
        raise typer.BadParameter(f"no stage consumes {topic}; pass --stage")
    stats = asyncio.run(run_replay(load_stage(name), settings, topic, concurrency=concurrency,
                                   blob_store=open_blob_store(settings)))
    out.print(f"replayed {stats.messages} messages: {stats.ok} ok, {stats.failed} failed, "
              f"{stats.malformed} malformed")


@app.command()
def stages() -> None:
    """The installed stages (entry point group kiln.stages): topics, ordering, models and handler."""
    table = Table("stage", "request topic", "partitions", "ordering", "events", "request / result", "handler")
    for kind, spec in sorted(stage_specs().items()):
        table.add_row(kind, spec.request_topic, str(spec.partitions), spec.ordering, spec.events_topic or "-",
                      f"{spec.request_model.__name__} / {spec.result_model.__name__}", spec.handler)
    out.print(table)


@app.command()
def gc(
    delete: Annotated[bool, typer.Option("--delete", help="Remove what is unreferenced (default: only report).")]
    = False,
    min_age_hours: Annotated[float, typer.Option(help="Never remove a blob younger than this.")] = 24.0,
) -> None:
    """The blob store's garbage collector: blobs no retained record, name or live blob references (dry run)."""
    from kiln.streams.blobstore import open_blob_store
    from kiln.streams.gc import collect

    settings = get_settings()
    with out.status("marking") as status:
        report = collect(settings, open_blob_store(settings), min_age_s=min_age_hours * 3600, delete=delete,
                         progress=lambda m: status.update(m))
    table = Table("blobs", "referenced", "younger than min age", "unreferenced", "bytes", "removed")
    table.add_row(str(report.blobs), str(report.referenced), str(report.young), str(len(report.unreferenced)),
                  str(report.unreferenced_bytes), str(report.removed))
    out.print(table)
    if not delete and report.unreferenced:
        out.print("dry run: nothing removed (--delete removes the unreferenced blobs)")


def _add_plugin_commands() -> None:
    """Commands other packages contribute (entry point group ``kiln.commands``: a Typer app or a function), e.g.
    ``kiln saucer``, ``kiln demo``, ``kiln tail``."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="kiln.commands"):
        try:
            command = ep.load()
        except ModuleNotFoundError as e:  # a command of an extra this installation lacks: it says which
            _needs_extra(ep.name, missing_extra(e, f"kiln {ep.name}"))
            continue
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=ep.name)
        else:  # a plain function is one command with its own arguments (e.g. ``kiln tail TOPIC``)
            app.command(name=ep.name)(command)


def _needs_extra(name: str, error: MissingExtra) -> None:
    """``kiln NAME …`` where NAME's module needs an extra that is not installed: says which, exits non-zero."""

    def command(ctx: typer.Context) -> None:
        raise error

    command.__doc__ = str(error)
    app.command(name=name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                             "help_option_names": []})(command)


_add_plugin_commands()


def main(argv: list[str] | None = None) -> None:
    """The ``kiln`` command: librdkafka's lines to the log file (``--verbose``: the terminal too), an unreachable
    broker found before a command waits on it, and every expected failure (a component kiln cannot reach or that
    refuses it, a missing extra, any ``KilnError``) said in one or two lines with a non-zero exit; a traceback only
    for a bug."""
    args = sys.argv[1:] if argv is None else argv
    try:
        settings = get_settings()
    except ValidationError as e:
        console.fail(f"invalid KILN_* setting: {e}")
        sys.exit(1)
    console.route_kafka_logs(settings, verbose="--verbose" in args)
    try:
        if console.waits_for_broker(args):
            console.wait_for_broker(settings)
        elif console.needs_broker(args):
            console.check_broker(settings)
        app(args=args, prog_name="kiln")
    except Exception as e:
        message = console.explain(e, settings, " ".join(["kiln", *(a for a in args if not a.startswith("-"))][:3]))
        if message is None:
            raise
        console.fail(message)
        sys.exit(console.EXIT_UNREACHABLE if isinstance(e, InfraError) or not isinstance(e, KilnError) else 1)


if __name__ == "__main__":
    main()
