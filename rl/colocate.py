"""The inference server and the trainer in one process, on one device: ``kiln rl train --serve-port``.

One GPU cannot hold the two ends of an NCCL group (two ranks on one device), and a gloo group would send every
update through host memory twice. Here the server's engine lives in the trainer's process: after each step the new
weights are copied device to device into fresh tensors and swapped in between two decode steps (``SameDevice``),
while the completion routes keep answering the rollout workers — sampling goes on while the trainer trains. The
engine keeps its own copy of the weights (its dtype may differ from the trainer's float32 master weights).
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from kiln.rl.train import RolloutTrainer, SameDevice, TrainSettings
from kiln.schemas.rl import PolicyUpdate
from kiln.streams.errors import ConfigError
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.engine import Engine
from kiln.workers.inference.model import TinyLM
from kiln.workers.inference.server import InferenceSettings, create_app
from kiln.workers.inference.tokenizer import load_tokenizer

log = logging.getLogger("kiln.rl.colocate")


def engine_for(serve: InferenceSettings) -> Engine:
    """The server's engine for ``serve.model`` on ``serve.device`` (kiln's TinyLM of ``serve``'s shape, or a
    Hugging Face model from its directory)."""
    if serve.model == "char":
        return Engine(TinyLM(serve.shape()), max_batch=serve.max_batch)
    from kiln.workers.inference.hf_engine import HFDecoder, load_causal_lm

    model = load_causal_lm(serve.model, serve.dtype, serve.device)
    max_len = serve.max_len if "max_len" in serve.model_fields_set else None
    return Engine(HFDecoder(model, serve.max_batch, max_len), max_batch=serve.max_batch,
                  tokenizer=load_tokenizer(serve.model))


def run_colocated(settings: KilnSettings, train: TrainSettings, serve: InferenceSettings,
                  max_steps: int | None = None, stop: threading.Event | None = None) -> list[PolicyUpdate]:
    """Serve ``serve.model`` on ``serve.port`` and train it from ``rollouts``; returns the trainer's events."""
    if serve.model != train.model:
        raise ConfigError(f"the server's model {serve.model!r} is not the trainer's {train.model!r}")
    if train.endpoints:
        raise ConfigError("a colocated trainer updates its own engine; KILN_TRAIN_ENDPOINTS must be empty")
    engine = engine_for(serve)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, serve), host=serve.host, port=serve.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="kiln-colocated-server", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise ConfigError(f"the colocated server did not start on {serve.host}:{serve.port}")
            time.sleep(0.05)
        trainer = RolloutTrainer(settings, train, broadcaster=SameDevice(engine, f"http://{serve.host}:{serve.port}"))
        if stop is not None:
            trainer.stop = stop
        return trainer.run(max_steps)
    finally:
        server.should_exit = True
        thread.join(15)
        engine.stop()
