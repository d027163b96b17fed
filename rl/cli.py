"""``kiln rl serve`` (the inference server, settings ``KILN_RL_*``), ``kiln rl train`` (the trainer on ``rollouts``,
settings ``KILN_TRAIN_*``), ``kiln rl actor`` (rollout requests, ``KILN_ACTOR_*``), ``kiln rl learn`` (a short
learning run of all of them on this machine) and ``kiln rl report`` (its picture)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

app = typer.Typer(help="Reinforcement learning: the inference server and the trainer.", no_args_is_help=True)


@app.command()
def serve(port: int | None = None, host: str | None = None,
          model: Annotated[str | None, typer.Option(help="'char' or a Hugging Face model's directory "
                                                    "(KILN_RL_MODEL)")] = None) -> None:
    """Serve the policy: OpenAI-shaped completions with continuous batching, and in-flight weight updates.
    SIGTERM stops it after the requests in flight are answered (uvicorn's graceful shutdown)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from kiln.streams.blobstore import open_blob_store
    from kiln.streams.errors import ConfigError
    from kiln.streams.settings import get_settings
    from kiln.workers.inference.engine import Engine
    from kiln.workers.inference.hf_engine import HFDecoder, load_causal_lm
    from kiln.workers.inference.model import TinyLM, load_checkpoint
    from kiln.workers.inference.server import InferenceSettings, create_app
    from kiln.workers.inference.tokenizer import load_tokenizer
    from kiln.workers.inference.weights import WeightReceiver

    torch.set_num_threads(1)  # two threads were 4x slower under contention on the 2-core machines
    settings = InferenceSettings()
    if port is not None:
        settings.port = port
    if host is not None:
        settings.host = host
    if model is not None:
        settings.model = model
    version = 0
    if settings.model != "char":
        if settings.checkpoint:
            raise ConfigError("KILN_RL_CHECKPOINT holds a character-model checkpoint; a Hugging Face model starts "
                              "from its directory (KILN_RL_MODEL)")
        tokenizer = load_tokenizer(settings.model)
        causal_lm = load_causal_lm(settings.model, settings.dtype, settings.device)
        # The model's own context unless KILN_RL_MAX_LEN says less (its default is the character model's).
        max_len = settings.max_len if "max_len" in settings.model_fields_set else None
        engine = Engine(HFDecoder(causal_lm, settings.max_batch, max_len), max_batch=settings.max_batch,
                        tokenizer=tokenizer)
    else:
        if settings.checkpoint:
            tiny, version = load_checkpoint(open_blob_store(get_settings()), settings.checkpoint)
        else:
            tiny = TinyLM(settings.shape())
        engine = Engine(tiny, max_batch=settings.max_batch, version=version)
    receiver = WeightReceiver(engine, staging=settings.staging)
    separate = settings.admin_port != 0
    servers = [uvicorn.Server(uvicorn.Config(create_app(engine, settings, receiver, admin=not separate),
                                             host=settings.host, port=settings.port, log_level="warning"))]
    if separate:
        servers.append(uvicorn.Server(uvicorn.Config(create_app(engine, settings, receiver, completions=False),
                                                     host=settings.admin_host, port=settings.admin_port,
                                                     log_level="warning")))

    async def run() -> None:
        # Only the last server to start holds the signal handlers: whichever is told to exit, all exit.
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        while not any(s.should_exit for s in servers):
            done, _ = await asyncio.wait(tasks, timeout=0.2)
            if done:
                break
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
    finally:
        engine.stop()


@app.command()
def train(max_steps: int | None = None,
          serve_port: Annotated[int | None, typer.Option(help="Also serve the policy on this port, from this process "
                                                              "and device (settings KILN_RL_*): each step's weights "
                                                              "go to the engine by a device copy")] = None) -> None:
    """Train on ``rollouts`` (settings: ``KILN_TRAIN_*``): a step per ``groups_per_step`` groups, its weights
    broadcast at once, its offsets committed once its checkpoint is written (in the background); SIGTERM stops after
    the current step (what was not committed is trained again by the next trainer)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import signal
    import threading

    import torch

    from kiln.rl.train import RolloutTrainer, TrainSettings
    from kiln.streams.settings import get_settings

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if serve_port is not None:
        from kiln.rl.colocate import run_colocated
        from kiln.workers.inference.server import InferenceSettings

        serve = InferenceSettings()
        serve.port = serve_port
        run_colocated(get_settings(), TrainSettings(), serve, max_steps, stop)
        return
    trainer = RolloutTrainer(get_settings(), TrainSettings())
    trainer.stop = stop
    trainer.run(max_steps)


@app.command()
def actor(groups: int | None = None, digits: int = 1, sync: bool = False, exec_image: str | None = None,
          seed: int = 0) -> None:
    """Produce rollout requests for the digit-addition task (settings: ``KILN_ACTOR_*``), at most ``max_ahead``
    groups beyond what the trainer has trained on; ``--sync``: the conventional loop (one step's groups, then wait
    for their update); ``--exec-image``: rewards from the exec stage in sessions on that image. SIGTERM stops
    submitting and waits for the answers."""
    import signal

    from kiln.rl.actor import Actor, ActorSettings
    from kiln.rl.tasks import Addition
    from kiln.streams.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = ActorSettings()
    config.sync = config.sync or sync

    async def run() -> None:
        runner = Actor(get_settings(), Addition(digits, seed=seed, exec_image=exec_image), config)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, runner.stop.set)
        await runner.run(groups)

    asyncio.run(run())


class _Evaluations(logging.Handler):
    """The learning run's evaluations on stdout as they are measured (the rest of its log stays in the log)."""

    def emit(self, record: logging.LogRecord) -> None:
        if "greedy accuracy" in (message := record.getMessage()):
            typer.echo(message.partition(": ")[2] or message)


@app.command()
def learn(
    out: Path = Path("rl-report.png"),
    steps: Annotated[int, typer.Option(help="Trainer steps at most (64 groups of 8 samples each).")] = 150,
    target: Annotated[float, typer.Option(help="Stop once held-out greedy accuracy reaches it.")] = 0.3,
    deadline_s: Annotated[float, typer.Option(help="Stop after this long, reached or not.")] = 150.0,
    workdir: Annotated[Path | None, typer.Option(help="Logs, checkpoints and the run's record (default: a temp "
                                                      "dir).")] = None,
) -> None:
    """A short learning run on this machine: a tiny model learns 1-digit addition from the rollout stage's rewards
    (``LearningRun``: inference server, rollout workers, trainer and actor, each its own process). Prints held-out
    greedy accuracy as it is measured, writes the run's record and the report picture ``out``."""
    from kiln.rl.local import LearningRun, RunConfig
    from kiln.rl.report import write_report
    from kiln.streams.settings import get_settings

    config = RunConfig(name="learn", steps=steps, target=target, deadline_s=deadline_s, eval_every_s=10)
    run = LearningRun(get_settings(), config, workdir=workdir)
    run.workdir.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger("kiln.rl.run")
    log.setLevel(logging.INFO)
    log.addHandler(_Evaluations())
    record = asyncio.run(run.run())
    (run.workdir / "record.json").write_text(record.model_dump_json())
    first, last = record.evaluations[0], record.evaluations[-1]
    typer.echo(f"held-out accuracy {first.accuracy:.2f} -> {last.accuracy:.2f} (best "
               f"{max(e.accuracy for e in record.evaluations):.2f}) in {record.wall_s:.0f} s, {last.version} trainer "
               f"steps, {record.rollouts} rollout groups; record {run.workdir / 'record.json'}")
    typer.echo(f"report: {write_report([record], out)}")


@app.command()
def report(records: list[Path], out: Path = Path("rl-report.png")) -> None:
    """Plot learning-run records (JSON, as ``bench/rl.py --record-dir`` writes them) into one PNG: reward and greedy
    accuracy vs wall-clock, the lag histogram, the paused fraction."""
    from kiln.rl.local import RunRecord
    from kiln.rl.report import write_report

    runs = [RunRecord.model_validate_json(path.read_text()) for path in records]
    typer.echo(write_report(runs, out))
