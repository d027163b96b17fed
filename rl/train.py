"""``kiln rl train``: the trainer as a consumer group on ``rollouts``.

Each step takes ``groups_per_step`` rollout groups, runs ``PolicyTrainer.step``, copies the new state to host memory
(the snapshot), broadcasts the weights to every inference server in flight and hands the snapshot to the checkpoint
writer: one background thread that writes it to the blob store (weights every step, the optimizer state every
``optimizer_every`` steps) while the next step trains, at most one write in flight. Once a checkpoint is durably
written, and only then, the consumed offsets of ``rollouts`` are committed with its digest as commit metadata and
the step's event goes out on ``policy.updates``. So the committed offsets are always those of a durable checkpoint: a
killed trainer restarts from the checkpoint its group's commit names and trains exactly the rollouts after it.

A server may have received the weights of a step whose checkpoint never got written (killed during the write): the
next life trains that version again from the same uncommitted rollouts and sends it again, so versions never go back,
though that version's weights are the new life's.

Every checkpoint names its parent and the ``rollouts`` offsets its step trained on (``ranges``): following the
parents from the committed checkpoint gives the run's lineage, which ``lineage()`` checks covers every rollout up to
the committed offsets exactly once, whatever was killed on the way. A checkpoint also names the newest optimizer state
(a blob of its own, written with every ``optimizer_every``-th step's): a trainer resumed from a checkpoint between two
optimizer writes gets the weights of its step and the optimizer state of at most ``optimizer_every - 1`` steps
before. Adam's moments that old are still the right size per parameter; a fresh optimizer would instead take its first
steps at the full learning rate in every coordinate (Adam's bias-corrected first step is about ``lr * sign(g)``).
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.rl.trainer import Group, PolicyTrainer, Precision, Sample, StepReport, hf_logits
from kiln.schemas.rl import PolicyUpdate, RolloutGroup
from kiln.streams import admin
from kiln.streams.blobstore import BlobStore, open_blob_store
from kiln.streams.errors import ConfigError
from kiln.streams.settings import KilnSettings, producer_config
from kiln.streams.stage import WEEK, TopicSpec
from kiln.workers.inference.endpoints import KilnEndpoint
from kiln.workers.inference.engine import Engine
from kiln.workers.inference.model import ModelShape, TinyLM
from kiln.workers.inference.tokenizer import load_tokenizer
from kiln.workers.inference.weights import UpdateReport, UpdateTimings, WeightBroadcaster

log = logging.getLogger("kiln.train")
ROLLOUTS, UPDATES = "rollouts", "policy.updates"


class TrainSettings(BaseSettings, ModelShape):
    """``KILN_TRAIN_*`` (a fresh policy's shape: ``KILN_TRAIN_D_MODEL`` …, see ``ModelShape``)."""

    model_config = SettingsConfigDict(env_prefix="KILN_TRAIN_", extra="ignore")

    model: str = Field("char", description="'char': kiln's TinyLM of the shape below; otherwise the directory of a "
                                           "Hugging Face causal LM (loaded with transformers, its tokenizer's pad "
                                           "id).")
    device: str = Field("cpu", description="Where the model trains (cpu, cuda, cuda:1 ...).")
    precision: Precision = Field("fp32", description="fp32, or bf16/fp16 autocast (float32 master weights).")
    micro_batch_tokens: int = Field(0, ge=0, description="Positions per forward/backward, the step's gradient "
                                                         "accumulated over them (0: the whole step at once).")
    optimizer_every: int = Field(10, ge=1, description="Write the optimizer state with every N-th checkpoint "
                                                       "(the weights go with every one).")
    group_id: str = Field("kiln-trainer", description="Consumer group on rollouts (one trainer per group).")
    groups_per_step: int = Field(64, ge=1, description="Rollout groups per optimizer step.")
    tokens_per_step: int = Field(0, ge=0, description="Step as soon as this many sampled tokens have arrived, even "
                                                      "with fewer groups (0: groups only).")
    lr: float = 1e-3
    pack_to: int = Field(0, ge=0, description="Pack sequences into rows of this many positions (0: a row each).")
    entropy_coef: float = 0.01
    max_ratio: float = 2.0
    temperature: float = 1.0
    endpoints: list[str] = Field(default_factory=list, description="Inference servers to update (JSON list).")
    admin_token: str = Field("", description="The servers' admin token.")
    master_address: str = Field("127.0.0.1", description="Address the servers reach the trainer's store on.")
    metrics_port: int = Field(0, ge=0, description="Prometheus port (0: none).")


registry = CollectorRegistry()
VERSION = Gauge("kiln_policy_version", "The trainer's latest policy version.", registry=registry)
LAG = Gauge("kiln_rollout_lag_versions", "Mean versions between a trained sample's first token and the step.",
            registry=registry)
STEPS = Counter("kiln_train_steps_total", "Optimizer steps checkpointed and committed.", registry=registry)
STEP_SECONDS = Histogram("kiln_train_step_seconds", "Forward, backward and optimizer step.", registry=registry)
PAUSED = Histogram("kiln_train_broadcast_pause_seconds", "Longest server pause of one weight update.",
                   buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0), registry=registry)


def _host_copy(value: Any) -> Any:
    """``value`` (a state dict, nested) with every tensor copied to host memory: the step after keeps changing the
    originals in place while the copy is being written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return value


@dataclass
class Snapshot:
    """A step's state in host memory, taken on the step's thread and written by the checkpoint writer."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # only every ``optimizer_every`` steps
    version: int
    groups_total: int
    config: dict[str, Any]
    ranges: dict[int, tuple[int, int]]


def snapshot(trainer: PolicyTrainer, groups_total: int, ranges: dict[int, tuple[int, int]] | None = None,
             optimizer: bool = True) -> Snapshot:
    model = trainer.model
    state = ({"optimizer": _host_copy(trainer.optimizer.state_dict()),
              "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else {}} if optimizer else None)
    return Snapshot(weights=_host_copy(model.state_dict()), optimizer=state, version=trainer.version,
                    groups_total=groups_total, config=model.config.model_dump() if isinstance(model, TinyLM) else {},
                    ranges=dict(ranges or {}))


def _blob(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def save_state(store: BlobStore, snap: Snapshot, parent: str = "", optimizer: str = "") -> tuple[str, str]:
    """Writes the snapshot's optimizer state (if it has one) and then its checkpoint, naming ``parent`` and the
    newest optimizer state (its own, or ``optimizer``, an earlier one's); returns (checkpoint, optimizer) digests.
    Both are durable when this returns (the blob store's ``put``)."""
    if snap.optimizer is not None:
        optimizer = store.put(_blob(snap.optimizer)).digest
    digest = store.put(_blob({
        "model": snap.weights, "optimizer": optimizer, "version": snap.version, "groups_total": snap.groups_total,
        "config": snap.config, "parent": parent, "ranges": {str(p): list(r) for p, r in snap.ranges.items()}})).digest
    return digest, optimizer


class Resumed(BaseModel):
    version: int
    groups_total: int
    optimizer: str = Field(description="digest of the optimizer state loaded ('' none: a fresh optimizer)")
    optimizer_version: int = Field(0, description="the version the optimizer state was written at")


class LineageStep(BaseModel):
    checkpoint: str
    version: int
    ranges: dict[int, tuple[int, int]]


def lineage(store: BlobStore, digest: str) -> list[LineageStep]:
    """The steps behind checkpoint ``digest``, oldest first."""
    steps: list[LineageStep] = []
    while digest:
        state = torch.load(io.BytesIO(store.get(digest)), weights_only=True)
        steps.append(LineageStep(checkpoint=digest, version=int(state["version"]),
                                 ranges={int(p): (int(r[0]), int(r[1])) for p, r in state["ranges"].items()}))
        digest = str(state["parent"])
    return steps[::-1]


def load_state(trainer: PolicyTrainer, store: BlobStore, digest: str) -> Resumed:
    """Restores the trainer from checkpoint ``digest``: its weights and version, and the newest optimizer state it
    names (see the module's docstring for why an older one rather than a fresh one)."""
    state = torch.load(io.BytesIO(store.get(digest)), weights_only=True, map_location="cpu")
    trainer.model.load_state_dict(state["model"])
    trainer.version = int(state["version"])
    optimizer, optimizer_version = str(state["optimizer"]), 0
    if optimizer:
        saved = torch.load(io.BytesIO(store.get(optimizer)), weights_only=True, map_location="cpu")
        trainer.optimizer.load_state_dict(saved["optimizer"])
        if trainer.scaler is not None and saved["scaler"]:
            trainer.scaler.load_state_dict(saved["scaler"])
        steps = [int(s["step"]) for s in saved["optimizer"]["state"].values()]
        optimizer_version = max(steps, default=0)
    return Resumed(version=trainer.version, groups_total=int(state["groups_total"]), optimizer=optimizer,
                   optimizer_version=optimizer_version)


def to_group(rollout: RolloutGroup) -> Group:
    """The group as the sampler saw it: the prompt's ids as it was tokenised once (``prompt_ids``) and each sample's
    ids as sampled, never tokenised again."""
    if not rollout.prompt_ids:
        raise ConfigError(f"rollout group {rollout.task_id} carries no prompt ids: a rollout stage older than this "
                          "trainer wrote it (the trainer trains on the ids the sampler saw, never re-tokenised text)")
    return Group(prompt=list(rollout.prompt_ids),
                 samples=[Sample(s.token_ids, s.logprobs, s.versions, s.reward, s.tool_mask) for s in rollout.samples
                          if s.token_ids])


class Broadcaster(Protocol):
    """How a step's weights reach the servers: ``WeightBroadcaster`` (process groups), or ``SameDevice`` for a
    server engine in the trainer's own process."""

    def update(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> UpdateReport: ...


class SameDevice:
    """The weight path of a server engine living in the trainer's process (one GPU: two processes cannot form an
    NCCL group on one device): each update copies the parameters into fresh tensors on the engine's device (so the
    trainer's next step does not change the weights the engine decodes with) and swaps them in between two decode
    steps."""

    def __init__(self, engine: Engine, url: str = "in-process") -> None:
        self.engine, self.url = engine, url

    def update(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> UpdateReport:
        started = time.perf_counter()
        params = dict(self.engine.model.named_parameters())
        staged = {name: t.detach().to(params[name].device, params[name].dtype, copy=True) for name, t in named}
        paused_before = self.engine.paused_s
        with self.engine.paused():
            replaced = self.engine.load(staged, version)
        del replaced
        timing = UpdateTimings(version=version, paused_ms=(self.engine.paused_s - paused_before) * 1000,
                               transfer_ms=(time.perf_counter() - started) * 1000)
        return UpdateReport(version=version, updated=[self.url], failed={}, timings={self.url: timing})


def load_policy(train: TrainSettings) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model ``train.model`` names, and the ``PolicyTrainer`` arguments it needs (an HF model: its logits and
    its tokenizer's pad id)."""
    if train.model == "char":
        return TinyLM(train.shape()), {}
    if train.pack_to:
        raise ConfigError("pack_to needs kiln's TinyLM (its forward takes segments); a Hugging Face model trains "
                          "on padded rows")
    from kiln.workers.inference.hf_engine import load_causal_lm

    return load_causal_lm(train.model, "float32", train.device), {"logits_of": hf_logits,
                                                                 "pad_id": load_tokenizer(train.model).pad_id}


@dataclass
class _Writing:
    """A checkpoint write in flight, and what to do once it is durable."""

    written: Future[tuple[str, str]]
    offsets: dict[int, int]
    event: PolicyUpdate


class RolloutTrainer:
    def __init__(self, settings: KilnSettings, train: TrainSettings, policy: torch.nn.Module | None = None,
                 broadcaster: Broadcaster | None = None) -> None:
        self.settings, self.train = settings, train
        model, extra = (policy, {}) if policy is not None else load_policy(train)
        self.trainer = PolicyTrainer(model, lr=train.lr, temperature=train.temperature, max_ratio=train.max_ratio,
                                     entropy_coef=train.entropy_coef, pack_to=train.pack_to, device=train.device,
                                     precision=train.precision, micro_batch_tokens=train.micro_batch_tokens,
                                     **extra)
        self.store = open_blob_store(settings)
        self.rollouts, self.updates = settings.topic(ROLLOUTS), settings.topic(UPDATES)
        admin.create_topics(settings, [TopicSpec(UPDATES, 1, WEEK)])
        self.broadcaster: Broadcaster | None = broadcaster or (WeightBroadcaster(
            [KilnEndpoint(url, admin_token=train.admin_token) for url in train.endpoints],
            master_address=train.master_address) if train.endpoints else None)
        self.producer = Producer(producer_config(settings))
        self.positions: dict[int, int] = {}
        self.checkpoint = ""  # the newest durable checkpoint
        self.optimizer_state = ""  # the newest durable optimizer state
        self.groups_total = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-checkpoint")
        self._writing: _Writing | None = None
        self._done: list[PolicyUpdate] = []
        self.stop = threading.Event()
        if train.metrics_port:
            start_http_server(train.metrics_port, registry=registry)

    def _on_revoke(self, consumer: Consumer, _partitions: list[TopicPartition]) -> None:
        """Commits the write in flight while the partitions are still this trainer's. If that fails, its rollouts
        replay: the next assignment loads the checkpoint the commits name, not the one written."""
        try:
            self._finish_write(consumer, block=True)
        except KafkaException as e:
            log.warning("could not commit the last step before a rebalance: %s", e)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._on_revoke(consumer, partitions)  # a write still in flight (no revocation came first)
        committed = consumer.committed(partitions, timeout=30)
        digests = {p.metadata for p in committed if p.metadata}
        if len(digests) > 1:
            log.warning("partitions of %s name different checkpoints %s; using the first", self.rollouts, digests)
        if digests and (digest := sorted(digests)[0]) != self.checkpoint:
            resumed = load_state(self.trainer, self.store, digest)
            self.groups_total = resumed.groups_total
            self.checkpoint, self.optimizer_state = digest, resumed.optimizer
            if isinstance(self.broadcaster, SameDevice):  # an engine in this process started from the initial weights
                self.broadcaster.update(self.trainer.named_weights(), resumed.version)
            log.info("resumed from checkpoint %s (version %d, %s)", digest, resumed.version,
                     f"optimizer state of version {resumed.optimizer_version}" if resumed.optimizer
                     else "no optimizer state written yet: a fresh optimizer")
        for p in committed:
            self.positions[p.partition] = max(p.offset, 0)

    def run(self, max_steps: int | None = None) -> list[PolicyUpdate]:
        """Steps until ``stop`` is set or after ``max_steps``; returns the steps' events (every one's checkpoint
        durable and its offsets committed)."""
        consumer = Consumer(self.settings.kafka(**{
            "group.id": self.train.group_id, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            **admin.group_membership(self.settings)}))
        consumer.subscribe([self.rollouts], on_assign=self._on_assign, on_revoke=self._on_revoke)
        if isinstance(self.broadcaster, WeightBroadcaster):
            failed = self.broadcaster.connect()
            if failed:
                log.warning("servers not in a weight group yet: %s", failed)
        self._done = []
        pending: list[tuple[Message, RolloutGroup]] = []
        tokens, steps = 0, 0
        try:
            while not self.stop.is_set() and (max_steps is None or steps < max_steps):
                # While a checkpoint is being written, look often: its commit and event wait on this loop.
                msg = consumer.poll(0.01 if self._writing is not None else 0.2)
                self._finish_write(consumer, block=False)
                if msg is None or msg.error() is not None:
                    continue
                group = RolloutGroup.model_validate_json(msg.value() or b"")
                pending.append((msg, group))
                tokens += sum(len(s.token_ids) for s in group.samples)
                enough_tokens = 0 < self.train.tokens_per_step <= tokens
                if len(pending) >= self.train.groups_per_step or enough_tokens:
                    self._step(consumer, pending)
                    steps += 1
                    pending, tokens = [], 0
            self._finish_write(consumer, block=True)
        finally:
            consumer.close()  # uncommitted rollouts replay into the next life's first step
            self._writer.shutdown(wait=False, cancel_futures=True)
            self.producer.flush(30)
        return self._done

    def _finish_write(self, consumer: Consumer, block: bool) -> None:
        """Once the write in flight is durable: commit its step's offsets naming it, and publish its event."""
        writing = self._writing
        if writing is None or not (block or writing.written.done()):
            return
        self._writing = None
        self.checkpoint, self.optimizer_state = writing.written.result()
        consumer.commit(offsets=[TopicPartition(self.rollouts, p, o, self.checkpoint)
                                 for p, o in writing.offsets.items()], asynchronous=False)
        event = writing.event.model_copy(update={"checkpoint": self.checkpoint})
        self.producer.produce(self.updates, event.model_dump_json().encode(), key=b"policy")
        self.producer.poll(0)
        STEPS.inc()
        self._done.append(event)

    def _step(self, consumer: Consumer, batch: list[tuple[Message, RolloutGroup]]) -> None:
        groups = [g for _m, g in batch]
        version_before = self.trainer.version
        lags = [version_before - s.versions[0] for g in groups for s in g.samples if s.versions]
        report: StepReport = self.trainer.step([to_group(g) for g in groups])
        self.groups_total += len(groups)
        ranges: dict[int, tuple[int, int]] = {}
        for msg, _group in batch:
            partition, offset = msg.partition(), msg.offset()
            if partition is not None and offset is not None:
                first, end = ranges.get(partition, (offset, offset + 1))
                ranges[partition] = (min(first, offset), max(end, offset + 1))
                self.positions[partition] = max(self.positions.get(partition, 0), offset + 1)
        snap = snapshot(self.trainer, self.groups_total, ranges,
                        optimizer=report.version % self.train.optimizer_every == 0)
        updated: list[str] = []
        failed: dict[str, str] = {}
        paused_ms = 0.0
        if self.broadcaster is not None:
            # A gloo group sends from host memory: the snapshot's copies, whatever device the trainer is on. NCCL
            # and an engine in this process take the device's tensors.
            host = isinstance(self.broadcaster, WeightBroadcaster) and self.broadcaster.backend == "gloo"
            named = ((n, snap.weights[n] if host else p) for n, p in self.trainer.named_weights())
            sent = self.broadcaster.update(named, report.version)
            updated, failed = sent.updated, sent.failed
            paused_ms = max((t.paused_ms for t in sent.timings.values()), default=0.0)
        # At most one write in flight: the previous step's is committed before this one's starts (it names it).
        self._finish_write(consumer, block=True)
        parent = self.checkpoint
        histogram: dict[int, int] = {}
        for lag in lags:
            histogram[lag] = histogram.get(lag, 0) + 1
        event = PolicyUpdate(version=report.version, checkpoint="", groups=len(groups),
                             groups_total=self.groups_total,
                             samples=report.sequences, reward_mean=report.reward_mean, loss=report.loss.loss,
                             entropy=report.loss.entropy, step_s=report.seconds,
                             lag_mean=sum(lags) / len(lags) if lags else 0.0, lag_max=max(lags, default=0),
                             lag_histogram=histogram, servers_updated=len(updated), servers_failed=failed,
                             paused_ms=paused_ms, parent=parent, ranges=ranges)
        self._writing = _Writing(self._writer.submit(save_state, self.store, snap, parent, self.optimizer_state),
                                 dict(self.positions), event)
        VERSION.set(event.version)
        LAG.set(event.lag_mean)
        STEP_SECONDS.observe(event.step_s)
        PAUSED.observe(paused_ms / 1000)
        log.info("step %d: reward %.3f, loss %.4f, lag %.2f", event.version, event.reward_mean, event.loss,
                 event.lag_mean)


def latest_update(settings: KilnSettings, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The newest event on ``policy.updates`` (what an actor reads for its back-pressure)."""
    consumer = Consumer(settings.kafka(**{"group.id": f"kiln-latest-{time.monotonic_ns()}",
                                          "enable.auto.commit": False}))
    try:
        tp = TopicPartition(settings.topic(UPDATES), 0)
        try:
            _low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s)
        except KafkaException as e:
            if e.args and e.args[0].code() in (KafkaError._UNKNOWN_PARTITION, KafkaError.UNKNOWN_TOPIC_OR_PART):
                return None  # no trainer has started yet: it creates the topic
            raise
        if high <= 0:
            return None
        consumer.assign([TopicPartition(tp.topic, 0, high - 1)])
        msg = consumer.poll(timeout_s)
        if msg is None or msg.error() is not None:
            return None
        result: dict[str, Any] = json.loads(msg.value() or b"{}")
        return result
    finally:
        consumer.close()
