"""Checkpoints off the step's path: weights with every step, the optimizer state with every N-th; a resumed
trainer gets its checkpoint's weights and the newest optimizer state it names; and a trainer SIGKILLed again and
again, whatever it was writing, resumes from a durable checkpoint and trains every rollout exactly once."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from confluent_kafka import Consumer, Producer, TopicPartition

from kiln.rl.train import latest_update, lineage, load_state, save_state, snapshot
from kiln.rl.trainer import Group, PolicyTrainer, Sample
from kiln.schemas.rl import RolloutGroup, RolloutSample
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.model import TOKENIZER, ModelConfig, TinyLM

torch.set_num_threads(1)


def _groups(rng: random.Random) -> list[Group]:
    groups = []
    for _ in range(4):
        a, b = rng.randrange(10), rng.randrange(10)
        prompt = TOKENIZER.encode(f"{a}+{b}=")
        samples = [Sample(TOKENIZER.encode(str(rng.randrange(19))), [-2.0] * 2, [0, 0], float(rng.random() < 0.5))
                   for _ in range(4)]
        groups.append(Group(prompt, [Sample(s.completion, s.logprobs[:len(s.completion)], s.versions, s.reward)
                                     for s in samples]))
    return groups


def test_a_snapshot_is_a_copy_the_next_step_leaves_alone() -> None:
    trainer = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), lr=1e-2)
    rng = random.Random(0)
    trainer.step(_groups(rng))
    snap = snapshot(trainer, groups_total=4)
    before = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    assert snap.optimizer is not None
    moments = {k: v["exp_avg"].clone() for k, v in snap.optimizer["optimizer"]["state"].items()}
    trainer.step(_groups(rng))
    assert all(torch.equal(snap.weights[n], t) for n, t in before.items())
    assert not all(torch.equal(t, trainer.model.state_dict()[n]) for n, t in before.items())
    assert all(torch.equal(snap.optimizer["optimizer"]["state"][k]["exp_avg"], m) for k, m in moments.items())


def test_weights_every_step_optimizer_every_nth_and_resume_from_between(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "blobs")
    trainer = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), lr=1e-2)
    rng = random.Random(0)
    parent, optimizer = "", ""
    written: list[tuple[str, str]] = []
    exp_avg: dict[int, torch.Tensor] = {}
    for version in range(1, 6):
        trainer.step(_groups(rng))
        exp_avg[version] = next(iter(trainer.optimizer.state.values()))["exp_avg"].clone()
        snap = snapshot(trainer, groups_total=4 * version, ranges={0: (4 * version - 4, 4 * version)},
                        optimizer=version % 2 == 0)
        parent, optimizer = save_state(store, snap, parent, optimizer)
        written.append((parent, optimizer))
    # The optimizer state went with versions 2 and 4 only; 3 and 5 name their predecessor's, 1 none.
    states = [o for _c, o in written]
    assert states[0] == "" and states[1] == states[2] and states[3] == states[4] and states[1] != states[3] != ""
    assert [s.version for s in lineage(store, written[-1][0])] == [1, 2, 3, 4, 5]

    resumed_trainer = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), lr=1e-2)
    resumed = load_state(resumed_trainer, store, written[2][0])  # version 3: weights of 3, optimizer of 2
    assert (resumed.version, resumed.groups_total, resumed.optimizer, resumed.optimizer_version) == (
        3, 12, states[1], 2)
    assert resumed_trainer.version == 3
    moments = next(iter(resumed_trainer.optimizer.state.values()))["exp_avg"]
    assert torch.equal(moments, exp_avg[2]) and not torch.equal(moments, exp_avg[3])
    fresh = PolicyTrainer(TinyLM(ModelConfig(max_len=32)), lr=1e-2)
    assert load_state(fresh, store, written[0][0]).optimizer == ""  # before any optimizer write: a fresh one
    assert fresh.optimizer.state_dict()["state"] == {}


def _produce_rollouts(settings: KilnSettings, count: int, seed: int) -> None:
    rng = random.Random(seed)
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    for i in range(count):
        a, b = rng.randrange(10), rng.randrange(10)
        samples = []
        for _ in range(4):
            answer = str(rng.randrange(19))
            ids = TOKENIZER.encode(answer)
            samples.append(RolloutSample(text=answer, token_ids=ids, logprobs=[-2.0] * len(ids),
                                         versions=[0] * len(ids), finish_reason="length",
                                         reward=float(answer == str(a + b))))
        group = RolloutGroup(task_id=f"add-{i}", prompt=f"{a}+{b}=", prompt_ids=TOKENIZER.encode(f"{a}+{b}="),
                             samples=samples, version_start=0, version_end=0, actor_version=0, endpoint="test",
                             generate_s=0.0, verify_s=0.0)
        producer.produce(settings.topic("rollouts"), group.model_dump_json().encode(), partition=i % 2)
    producer.flush(30)


def _committed(settings: KilnSettings, group: str) -> list[TopicPartition]:
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": group})
    try:
        return consumer.committed([TopicPartition(settings.topic("rollouts"), p) for p in range(2)], timeout=10)
    finally:
        consumer.close()


def test_sigkilled_trainers_resume_from_durable_checkpoints_and_train_every_rollout_once(
        stage_topics: Callable[..., KilnSettings], tmp_path: Path, unique: str) -> None:
    settings = stage_topics(("rollouts", 2))
    settings = settings.model_copy(update={"blob_store": f"file://{tmp_path / 'blobs'}"})
    groups, per_step = 32, 2
    _produce_rollouts(settings, groups, seed=1)
    group_id = f"trainer-{unique}"
    # A bigger model than the default (3.2M parameters, 38 MB with Adam's state) keeps the writer busy for a while
    # after each step, so the kills land in writes as well as in steps.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILN_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache),
           "KILN_BLOB_STORE": settings.blob_store, "KILN_TRAIN_GROUP_ID": group_id,
           "KILN_TRAIN_GROUPS_PER_STEP": str(per_step), "KILN_TRAIN_OPTIMIZER_EVERY": "3",
           "KILN_TRAIN_D_MODEL": "256", "KILN_TRAIN_N_LAYERS": "4", "KILN_TRAIN_MAX_LEN": "32"}
    kiln = Path(sys.executable).parent / "kiln"
    rng = random.Random(7)
    kills = 0
    log = (tmp_path / "trainer.log").open("ab")
    try:
        for life in range(4):
            proc = subprocess.Popen([str(kiln), "rl", "train"], env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                seen_before = int((latest_update(settings, 5) or {}).get("version", 0))
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline:
                    latest = int((latest_update(settings, 5) or {}).get("version", 0))
                    if life < 3 and latest >= seen_before + 2:
                        time.sleep(rng.uniform(0.0, 0.6))  # anywhere in a step or a checkpoint write
                        proc.send_signal(signal.SIGKILL)
                        proc.wait(10)
                        kills += 1
                        break
                    if sum(max(p.offset, 0) for p in _committed(settings, group_id)) == groups:
                        break
                    assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
                    time.sleep(0.2)
                else:
                    raise AssertionError(f"life {life} made no progress: {(tmp_path / 'trainer.log').read_text()}")
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(30)
    finally:
        log.close()
    assert kills == 3
    committed = _committed(settings, group_id)
    assert sum(p.offset for p in committed) == groups
    digests = {str(p.metadata) for p in committed}
    assert len(digests) == 1
    steps = lineage(FileBlobStore(tmp_path / "blobs"), digests.pop())
    assert [s.version for s in steps] == list(range(1, groups // per_step + 1))  # every step once, none lost
    for partition in range(2):
        spans = sorted(s.ranges[partition] for s in steps if partition in s.ranges)
        assert spans[0][0] == 0 and spans[-1][1] == groups // 2
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gap, no overlap
