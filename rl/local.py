"""A whole learning run on one machine, every part its own process: the inference server, exec workers, rollout
workers, the trainer (``kiln rl train``) and the actor (``kiln rl actor``), over the broker, with greedy evaluation
of the policy the server holds as it learns. Optionally SIGKILLs the trainer and a rollout worker mid-run (each
restarted at once, as a preempted node's replacement would be).

The end-to-end test runs a bounded one, ``bench/rl.py`` an async and a sync one side by side; ``RunRecord`` is what
``kiln rl report`` plots.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Literal

import httpx
from confluent_kafka import Consumer, TopicPartition
from pydantic import BaseModel, Field, model_validator

from kiln.rl.actor import UpdateFollower
from kiln.rl.tasks import Addition, exact_match
from kiln.rl.train import ROLLOUTS, UPDATES, lineage
from kiln.schemas.rl import PolicyUpdate, RolloutGroup
from kiln.streams import admin
from kiln.streams.blobstore import open_blob_store
from kiln.streams.processes import WorkerProcess, free_port, wait_healthy
from kiln.streams.replay import read_topic
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.inference.model import ModelConfig
from kiln.workers.inference.process import ServerProcess
from kiln.workers.inference.tokenizer import load_tokenizer, tokenize_prompt

log = logging.getLogger("kiln.rl.run")


class RunConfig(BaseModel):
    name: str = "async"
    model: str = Field("char", description="'char' (kiln's TinyLM, d_model/n_layers below) or a Hugging Face model's "
                                           "directory: every process the run spawns serves, samples, tokenises or "
                                           "trains that model")
    sync: bool = False
    steps: int = Field(150, ge=1, description="Trainer steps; the actor submits steps x groups_per_step groups.")
    groups_per_step: int = 64
    n: int = Field(8, description="samples per group")
    lr: float = 1e-3
    entropy_coef: float = Field(0.03, description="measured on this machine (in process, seeds 1-3, 64x8 samples): "
                                                  "0.03 reached 0.25 held-out greedy accuracy in 110-140 steps, 0.01 "
                                                  "in 250 steps or not within 300, 0.003 and 0.1 never")
    max_tokens: int = Field(2, description="a sum of two digits has at most two: a third token only adds ways to be "
                                           "wrong")
    max_ahead: int = Field(192, description="groups the actor may run ahead of the trainer (sync: one step's)")
    rollout_workers: int = 2
    rollout_slots: int = 32
    exec_workers: int = 1
    exec_slots: int = 4
    exec_image: str | None = Field(None, description="verify in exec sessions on this image; None: in process")
    d_model: int = 64
    n_layers: int = 2
    seed: int = 0
    eval_every_s: float = 10.0
    target: float | None = Field(None, description="stop once greedy accuracy reaches it")
    deadline_s: float = 600.0
    kill_trainer_at: int | None = Field(None, description="SIGKILL the trainer once this version is out")
    kill_rollout_at: int | None = Field(None, description="SIGKILL a rollout worker once this version is out")
    device: str = Field("cpu", description="where the server and the trainer run the model (cpu, cuda ...)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the server's (an HF model)")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="the trainer's autocast")
    colocate: bool = Field(False, description="the server in the trainer's process, on its device (one GPU: "
                                              "``kiln rl train --serve-port``); no kill_trainer_at then")

    @model_validator(mode="after")
    def _kills_need_a_separate_server(self) -> RunConfig:
        if self.colocate and self.kill_trainer_at is not None:
            raise ValueError("a colocated trainer takes the server with it: no kill_trainer_at")
        return self


def addition_model(out: Path, seed: int = 0) -> Path:
    """A tiny Llama for the addition task, built in ``out`` (``hf.build_tiny_model``): a vocabulary from the task's
    text (110 ids: byte-level printable ASCII, the specials and a few merges, every digit a token of its own),
    hidden 64, 2 layers. Measured in one process on this machine (16 groups x 8 samples a step, lr 1e-2, entropy
    0.003): training reward 0.02 -> 0.09 and held-out greedy accuracy 0 -> 0.10 within 30 steps; lr 3e-3 took 60."""
    from kiln.workers.inference.hf import build_tiny_model

    corpus = [t.prompt + t.answer for t in Addition(1, seed=seed).sample(300)]
    return build_tiny_model(out, corpus, vocab_size=110, hidden=64, layers=2, heads=4, seed=seed, max_len=128)


class Evaluation(BaseModel):
    t: float
    version: int
    accuracy: float


class RunRecord(BaseModel):
    config: RunConfig
    wall_s: float
    evaluations: list[Evaluation]
    updates: list[tuple[float, PolicyUpdate]] = Field(description="(seconds since start, event)")
    paused_s: float = Field(description="decoding stood still for weight updates, on the server")
    rollouts: int = Field(description="groups on rollouts")
    trained_groups: int = Field(description="groups in the committed checkpoint's lineage")
    lineage_ok: bool = Field(description="the lineage covers every rollout up to the committed offsets exactly once")
    versions_monotonic: bool = Field(description="the versions the server answered with never went back")
    kills: list[str]
    dead_letters: int
    verified_by: dict[str, int] = Field(description="samples on rollouts per verifier that rewarded them")

    @property
    def time_to_target(self) -> float | None:
        target = self.config.target
        return next((e.t for e in self.evaluations if target is not None and e.accuracy >= target), None)

    @property
    def samples_per_s(self) -> float:
        return sum(u.samples for _t, u in self.updates) / self.wall_s if self.wall_s else 0.0


def _topics(settings: KilnSettings) -> list[TopicSpec]:
    specs = [TopicSpec("kiln.results", 4), TopicSpec(ROLLOUTS, 4), TopicSpec(UPDATES, 1)]
    for name, partitions in (("rollout.requests", 8), ("exec.requests", 4)):
        specs += [TopicSpec(name, partitions), TopicSpec(f"{name}.dlq", 1)]
    return specs


class LearningRun:
    def __init__(self, base: KilnSettings, config: RunConfig, workdir: Path | None = None) -> None:
        self.config = config
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"kiln-rl-{config.name}-"))
        # The run's topics carry the pid of the process that runs it (six hex digits, then two random ones), so a
        # test session purging leftover rl<hex>. topics can tell a live run's from a dead one's.
        tag = f"{os.getpid():06x}{uuid.uuid4().hex[:2]}"
        self.settings = base.model_copy(update={"topic_prefix": f"rl{tag}.", "cache": self.workdir / "cache",
                                                "blob_store": f"file://{self.workdir / 'cache' / 'blobs'}"})
        self.trainer_group = f"trainer-{tag}"
        # A chat template makes an HF model's prompts longer than the character model's bare ones.
        self.shape = ModelConfig(d_model=config.d_model, n_layers=config.n_layers,
                                 max_len=32 if config.model == "char" else 128, seed=config.seed)
        self.server = ServerProcess(self.shape, self.workdir / "serve.log", env={
            "KILN_RL_MODEL": config.model, "KILN_RL_DEVICE": config.device, "KILN_RL_DTYPE": config.dtype})
        self.tokenizer = load_tokenizer(config.model)
        self.tasks = Addition(1, seed=config.seed, exec_image=config.exec_image)
        self.kills: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._workers: list[WorkerProcess] = []

    def _env(self, **extra: str) -> dict[str, str]:
        s = self.settings
        return {**os.environ, "OMP_NUM_THREADS": "1", "KILN_BOOTSTRAP_SERVERS": s.bootstrap_servers,
                "KILN_TOPIC_PREFIX": s.topic_prefix, "KILN_CACHE": str(s.cache), "KILN_BLOB_STORE": s.blob_store,
                "KILN_ROLLOUT_MODEL": self.config.model, "KILN_ACTOR_MODEL": self.config.model, **extra}

    def _spawn(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        kiln = Path(sys.executable).parent / "kiln"
        with (self.workdir / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen([str(kiln), *args], env=self._env(**env), stdout=out, stderr=subprocess.STDOUT)
        self._procs.append(proc)
        return proc

    def _trainer(self) -> subprocess.Popen[bytes]:
        c = self.config
        env = {"KILN_TRAIN_GROUP_ID": self.trainer_group, "KILN_TRAIN_GROUPS_PER_STEP": str(c.groups_per_step),
               "KILN_TRAIN_LR": str(c.lr), "KILN_TRAIN_ENTROPY_COEF": str(c.entropy_coef),
               "KILN_TRAIN_MODEL": c.model, "KILN_TRAIN_DEVICE": c.device, "KILN_TRAIN_PRECISION": c.precision,
               "KILN_TRAIN_D_MODEL": str(c.d_model), "KILN_TRAIN_N_LAYERS": str(c.n_layers),
               "KILN_TRAIN_MAX_LEN": str(self.shape.max_len), "KILN_TRAIN_SEED": str(c.seed)}
        if not c.colocate:
            return self._spawn("trainer", ["rl", "train"], KILN_TRAIN_ENDPOINTS=json.dumps([self.server.url]),
                               KILN_TRAIN_ADMIN_TOKEN=self.server.token, **env)
        s = self.shape
        proc = self._spawn("trainer", ["rl", "train", "--serve-port", str(self.server.port)],
                           KILN_RL_MODEL=c.model, KILN_RL_DEVICE=c.device, KILN_RL_DTYPE=c.dtype,
                           KILN_RL_ADMIN_TOKEN=self.server.token, KILN_RL_D_MODEL=str(s.d_model),
                           KILN_RL_N_LAYERS=str(s.n_layers), KILN_RL_N_HEADS=str(s.n_heads),
                           KILN_RL_MAX_LEN=str(s.max_len), KILN_RL_SEED=str(s.seed), **env)
        wait_healthy(proc, self.server.url, self.workdir / "trainer.log", "kiln rl train --serve-port", 300)
        return proc

    def _rollout_worker(self) -> WorkerProcess:
        worker = WorkerProcess("rollout", self.settings, "rollout.requests", slots=self.config.rollout_slots,
                               env=self._env(KILN_ROLLOUT_ENDPOINTS=json.dumps([self.server.url]),
                                             KILN_METRICS_PORT=str(free_port())))
        self._workers.append(worker)
        return worker

    async def evaluate(self, http: httpx.AsyncClient) -> tuple[int, float]:
        """Greedy accuracy over the task's held-out prompts (never trained on), and the version that answered. The
        prompts go as the rollout stage sends them: token ids, through the model's chat template."""
        prompts = self.tasks.held_out()
        ids = [tokenize_prompt(self.tokenizer, t.prompt) for t in prompts]
        answer = (await http.post(f"{self.server.url}/v1/completions", json={
            "prompt": ids, "max_tokens": self.config.max_tokens, "temperature": 0})).json()
        right = sum(exact_match(t, c["text"]) for t, c in zip(prompts, answer["choices"], strict=True))
        return int(answer["kiln"]["version_start"]), right / len(prompts)

    async def run(self, *, keep_topics: bool = False) -> RunRecord:
        """One learning run on its own topics, deleted when it ends (a broker loads every partition's log when it
        starts, so topics left run after run slow it); ``keep_topics`` leaves them for the caller to read (its
        ``rollouts``, ``policy.updates``) and then ``delete_topics``."""
        try:
            return await self._run()
        finally:
            if not keep_topics:
                self.delete_topics()

    def delete_topics(self) -> None:
        """Delete this run's topics (idempotent: what is already gone is not a problem)."""
        names = [self.settings.topic(t.name) for t in _topics(self.settings)]
        for problem in admin.delete_topics(self.settings, names):
            if "UNKNOWN_TOPIC" not in problem:
                log.warning("%s: could not delete a topic: %s", self.config.name, problem)

    async def _run(self) -> RunRecord:
        c = self.config
        admin.create_topics(self.settings, _topics(self.settings))
        # Colocated, the trainer's process serves: it starts first (it must answer before anything samples).
        trainer = await asyncio.to_thread(self._trainer) if c.colocate else None
        if not c.colocate:
            self.server.start()
        started = time.monotonic()
        evaluations: list[Evaluation] = []
        follower = UpdateFollower(self.settings, asyncio.get_running_loop())
        try:
            for _ in range(c.exec_workers if c.exec_image else 0):
                self._workers.append(WorkerProcess(
                    "exec", self.settings, "exec.requests", slots=c.exec_slots,
                    env=self._env(KILN_EXEC_LOCK_DIR=str(self.workdir / "locks"), KILN_EXEC_WARM="1",
                                  KILN_METRICS_PORT=str(free_port()))))
            rollout = [self._rollout_worker() for _ in range(c.rollout_workers)]
            for worker in self._workers:
                await asyncio.to_thread(worker.wait_assigned, 120)
            trainer = self._trainer()
            # The run's seed picks the actor's tasks (the held-out split evaluated here is the same seed's) and
            # seeds every group's sampling.
            actor = self._spawn("actor", ["rl", "actor", "--groups", str(c.steps * c.groups_per_step),
                                          "--seed", str(c.seed),
                                          *(["--exec-image", c.exec_image] if c.exec_image else [])],
                                KILN_ACTOR_CLIENT_ID=f"actor-{uuid.uuid4().hex[:6]}", KILN_ACTOR_N=str(c.n),
                                KILN_ACTOR_MAX_TOKENS=str(c.max_tokens), KILN_ACTOR_SEED=str(c.seed),
                                KILN_ACTOR_MAX_AHEAD=str(c.groups_per_step if c.sync else c.max_ahead),
                                KILN_ACTOR_SYNC=str(c.sync).lower())
            started = time.monotonic()
            next_eval = started
            async with httpx.AsyncClient(timeout=120) as http:
                while time.monotonic() - started < c.deadline_s:
                    version = int(follower.latest.get("version", 0))
                    if c.kill_trainer_at is not None and version >= c.kill_trainer_at and "trainer" not in self.kills:
                        trainer.kill()
                        trainer.wait()
                        self.kills.append("trainer")
                        log.info("%s: trainer killed at version %d", c.name, version)
                        trainer = self._trainer()
                    if c.kill_rollout_at is not None and version >= c.kill_rollout_at and "rollout" not in self.kills:
                        await asyncio.to_thread(rollout[0].kill)
                        self.kills.append("rollout")
                        log.info("%s: a rollout worker killed at version %d", c.name, version)
                        rollout[0] = self._rollout_worker()
                    if time.monotonic() >= next_eval:
                        version, accuracy = await self.evaluate(http)
                        evaluations.append(Evaluation(t=time.monotonic() - started, version=version,
                                                      accuracy=accuracy))
                        log.info("%s: %.0fs version %d greedy accuracy %.2f", c.name, evaluations[-1].t, version,
                                 accuracy)
                        next_eval += c.eval_every_s
                        if c.target is not None and accuracy >= c.target:
                            break
                    if version >= c.steps:
                        break
                    if trainer.poll() is not None:
                        raise RuntimeError(f"the trainer exited {trainer.returncode}: "
                                           f"{(self.workdir / 'trainer.log').read_text()[-3000:]}")
                    await asyncio.sleep(0.5)
                wall = time.monotonic() - started
                version, accuracy = await self.evaluate(http)
                evaluations.append(Evaluation(t=wall, version=version, accuracy=accuracy))
            del actor
            paused = self.server.metric("kiln_inference_pause_seconds_sum")
        finally:
            follower.close()
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            WorkerProcess.stop_all(self._workers, 30)
            self.server.stop()
        return self._record(wall, evaluations, paused)

    def _record(self, wall: float, evaluations: list[Evaluation], paused: float) -> RunRecord:
        updates = self._updates()
        t0 = updates[0][0] - updates[0][1].step_s if updates else 0.0
        consumer = Consumer(self.settings.kafka(**{"group.id": self.trainer_group, "enable.auto.commit": False}))
        try:
            partitions = [TopicPartition(self.settings.topic(ROLLOUTS), p) for p in range(4)]
            committed = consumer.committed(partitions, timeout=30)
            ends = [consumer.get_watermark_offsets(p, timeout=30)[1] for p in partitions]
        finally:
            consumer.close()
        digests = {p.metadata for p in committed if p.metadata}
        steps = lineage(open_blob_store(self.settings), sorted(digests)[0]) if len(digests) == 1 else []
        covered: dict[int, list[tuple[int, int]]] = {}
        for step in steps:
            for partition, span in step.ranges.items():
                covered.setdefault(partition, []).append(span)
        exact = len(digests) == 1 and all(
            _tiles(sorted(covered.get(p.partition, [])), max(p.offset, 0)) for p in committed)
        versions = [e.version for e in evaluations]
        verified_by: dict[str, int] = {}
        for message in read_topic(self.settings, ROLLOUTS):
            for sample in RolloutGroup.model_validate_json(message.value() or b"").samples:
                name = str(sample.verifier.get("name", ""))
                verified_by[name] = verified_by.get(name, 0) + 1
        return RunRecord(
            config=self.config, wall_s=wall, evaluations=evaluations,
            updates=[(t - t0, u) for t, u in updates], paused_s=paused, rollouts=sum(ends),
            trained_groups=sum(end - first for s in steps for first, end in s.ranges.values()),
            lineage_ok=exact and [s.version for s in steps] == list(range(1, len(steps) + 1)),
            versions_monotonic=versions == sorted(versions), kills=self.kills, verified_by=verified_by,
            dead_letters=sum(len(read_topic(self.settings, f"{name}.dlq"))
                             for name in ("rollout.requests", "exec.requests")))

    def _updates(self) -> list[tuple[float, PolicyUpdate]]:
        return [(m.timestamp()[1] / 1000, PolicyUpdate.model_validate_json(m.value() or b""))
                for m in read_topic(self.settings, UPDATES)]


def _tiles(spans: list[tuple[int, int]], end: int) -> bool:
    """The spans cover [0, end) with no gap and no overlap."""
    position = 0
    for first, last in spans:
        if first != position:
            return False
        position = last
    return position == end

