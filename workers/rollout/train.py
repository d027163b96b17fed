"""``kiln rl train``: the trainer as a consumer group on ``rollouts``.

Each step takes ``groups_per_step`` rollout groups, runs ``PolicyTrainer.step``, then, in this order: writes a
checkpoint (weights, optimizer, version) to the blob store, commits the consumed offsets of ``rollouts`` with the
checkpoint's digest as commit metadata, broadcasts the weights to every inference server in flight, and publishes an
event on ``policy.updates``. So the committed offsets are always those of a durable checkpoint: a killed trainer
restarts from the checkpoint its group's commit names and trains exactly the rollouts after it, and no server ever
sees a version the checkpoint does not have (versions never go back).

Every checkpoint names its parent and the ``rollouts`` offsets its step trained on (``ranges``): following the
parents from the committed checkpoint gives the run's lineage, which ``lineage()`` checks covers every rollout up to
the committed offsets exactly once, whatever was killed on the way.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from typing import Any

import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.rl import RolloutGroup
from kiln.streams import admin
from kiln.streams.blobstore import BlobStore, open_blob_store
from kiln.streams.executor import producer_config
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import WEEK, TopicSpec
from kiln.workers.inference.endpoints import KilnEndpoint
from kiln.workers.inference.model import TOKENIZER, ModelShape, TinyLM
from kiln.workers.inference.weights import WeightBroadcaster
from kiln.workers.rollout.trainer import Group, PolicyTrainer, Sample, StepReport

log = logging.getLogger("kiln.train")
ROLLOUTS, UPDATES = "rollouts", "policy.updates"


class TrainSettings(BaseSettings, ModelShape):
    """``KILN_TRAIN_*`` (a fresh policy's shape: ``KILN_TRAIN_D_MODEL`` …, see ``ModelShape``)."""

    model_config = SettingsConfigDict(env_prefix="KILN_TRAIN_", extra="ignore")

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


class PolicyUpdate(BaseModel):
    """One event on ``policy.updates``."""

    version: int
    checkpoint: str
    groups: int
    groups_total: int = Field(description="groups trained on since the first step (carried in the checkpoint)")
    samples: int
    reward_mean: float
    loss: float
    entropy: float
    step_s: float
    lag_mean: float = Field(description="versions between the one a sample started with and this step's")
    lag_max: int
    lag_histogram: dict[int, int] = Field(default_factory=dict, description="samples per lag in versions")
    servers_updated: int
    servers_failed: dict[str, str]
    paused_ms: float = Field(0.0, description="the longest pause of decoding on a server for this update")
    parent: str = Field("", description="the checkpoint this step started from")
    ranges: dict[int, tuple[int, int]] = Field(default_factory=dict,
                                               description="rollouts partition -> [first, end) offsets trained on")


def save_state(trainer: PolicyTrainer, store: BlobStore, groups_total: int, parent: str = "",
               ranges: dict[int, tuple[int, int]] | None = None) -> str:
    buffer = io.BytesIO()
    model = trainer.model
    config = model.config.model_dump() if isinstance(model, TinyLM) else {}
    torch.save({"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "version": trainer.version, "groups_total": groups_total, "config": config, "parent": parent,
                "ranges": {str(p): list(r) for p, r in (ranges or {}).items()}}, buffer)
    return store.put(buffer.getvalue()).digest


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


def load_state(trainer: PolicyTrainer, store: BlobStore, digest: str) -> int:
    """Restores the trainer; returns the groups trained on so far."""
    state = torch.load(io.BytesIO(store.get(digest)), weights_only=True)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.version = int(state["version"])
    return int(state["groups_total"])


def to_group(rollout: RolloutGroup) -> Group:
    return Group(prompt=TOKENIZER.encode(rollout.prompt),
                 samples=[Sample(s.token_ids, s.logprobs, s.versions, s.reward, s.tool_mask) for s in rollout.samples
                          if s.token_ids])


class RolloutTrainer:
    def __init__(self, settings: KilnSettings, train: TrainSettings, policy: torch.nn.Module | None = None) -> None:
        self.settings, self.train = settings, train
        model = policy or TinyLM(train.shape())
        self.trainer = PolicyTrainer(model, lr=train.lr, temperature=train.temperature, max_ratio=train.max_ratio,
                                     entropy_coef=train.entropy_coef, pack_to=train.pack_to)
        self.store = open_blob_store(settings)
        self.rollouts, self.updates = settings.topic(ROLLOUTS), settings.topic(UPDATES)
        admin.create_topics(settings, [TopicSpec(UPDATES, 1, WEEK)])
        self.broadcaster = WeightBroadcaster(
            [KilnEndpoint(url, admin_token=train.admin_token) for url in train.endpoints],
            master_address=train.master_address) if train.endpoints else None
        self.producer = Producer(producer_config(settings))
        self.positions: dict[int, int] = {}
        self.checkpoint = ""
        self.groups_total = 0
        self.stop = threading.Event()
        if train.metrics_port:
            start_http_server(train.metrics_port, registry=registry)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        committed = consumer.committed(partitions, timeout=30)
        digests = {p.metadata for p in committed if p.metadata}
        if len(digests) > 1:
            log.warning("partitions of %s name different checkpoints %s; using the first", self.rollouts, digests)
        if digests and (digest := sorted(digests)[0]) != self.checkpoint:
            self.groups_total = load_state(self.trainer, self.store, digest)
            self.checkpoint = digest
            log.info("resumed from checkpoint %s (version %d)", digest, self.trainer.version)
        for p in committed:
            self.positions[p.partition] = max(p.offset, 0)

    def run(self, max_steps: int | None = None) -> list[PolicyUpdate]:
        consumer = Consumer(self.settings.kafka(**{
            "group.id": self.train.group_id, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            **admin.group_membership(self.settings)}))
        consumer.subscribe([self.rollouts], on_assign=self._on_assign)
        if self.broadcaster is not None:
            failed = self.broadcaster.connect()
            if failed:
                log.warning("servers not in a weight group yet: %s", failed)
        done: list[PolicyUpdate] = []
        pending: list[tuple[Message, RolloutGroup]] = []
        tokens = 0
        try:
            while not self.stop.is_set() and (max_steps is None or len(done) < max_steps):
                msg = consumer.poll(0.2)
                if msg is None or msg.error() is not None:
                    continue
                group = RolloutGroup.model_validate_json(msg.value() or b"")
                pending.append((msg, group))
                tokens += sum(len(s.token_ids) for s in group.samples)
                enough_tokens = 0 < self.train.tokens_per_step <= tokens
                if len(pending) >= self.train.groups_per_step or enough_tokens:
                    done.append(self._step(consumer, pending))
                    pending, tokens = [], 0
        finally:
            consumer.close()  # uncommitted rollouts replay into the next life's first step
            self.producer.flush(30)
        return done

    def _step(self, consumer: Consumer, batch: list[tuple[Message, RolloutGroup]]) -> PolicyUpdate:
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
        parent = self.checkpoint
        self.checkpoint = save_state(self.trainer, self.store, self.groups_total, parent, ranges)
        consumer.commit(offsets=[TopicPartition(self.rollouts, p, o, self.checkpoint)
                                 for p, o in self.positions.items()], asynchronous=False)
        updated: list[str] = []
        failed: dict[str, str] = {}
        paused_ms = 0.0
        if self.broadcaster is not None:
            sent = self.broadcaster.update(self.trainer.named_weights(), report.version)
            updated, failed = sent.updated, sent.failed
            paused_ms = max((t.paused_ms for t in sent.timings.values()), default=0.0)
        histogram: dict[int, int] = {}
        for lag in lags:
            histogram[lag] = histogram.get(lag, 0) + 1
        event = PolicyUpdate(version=report.version, checkpoint=self.checkpoint, groups=len(groups),
                             groups_total=self.groups_total,
                             samples=report.sequences, reward_mean=report.reward_mean, loss=report.loss.loss,
                             entropy=report.loss.entropy, step_s=report.seconds,
                             lag_mean=sum(lags) / len(lags) if lags else 0.0, lag_max=max(lags, default=0),
                             lag_histogram=histogram, servers_updated=len(updated), servers_failed=failed,
                             paused_ms=paused_ms, parent=parent, ranges=ranges)
        VERSION.set(event.version)
        LAG.set(event.lag_mean)
        STEPS.inc()
        STEP_SECONDS.observe(event.step_s)
        PAUSED.observe(paused_ms / 1000)
        self.producer.produce(self.updates, event.model_dump_json().encode(), key=b"policy")
        self.producer.poll(0)
        log.info("step %d: reward %.3f, loss %.4f, lag %.2f", event.version, event.reward_mean, event.loss,
                 event.lag_mean)
        return event


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
