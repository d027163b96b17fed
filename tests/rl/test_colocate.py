"""The server in the trainer's process (one device, ``kiln rl train --serve-port``): each step's weights reach the
engine as a copy swapped in between two decode steps, and a learning run through every stage works that way."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.rl.local import LearningRun, RunConfig
from kiln.rl.train import SameDevice
from kiln.rl.trainer import Group, PolicyTrainer, Sample
from kiln.streams import admin
from kiln.streams.settings import KilnSettings
from kiln.workers.inference.engine import Engine, SamplingParams
from kiln.workers.inference.model import TOKENIZER, ModelConfig, TinyLM, weights_digest

torch.set_num_threads(1)


def _group() -> Group:
    prompt = TOKENIZER.encode("3+4=")
    answers = (("7\n", 1.0), ("9\n", 0.0))
    return Group(prompt, [Sample(TOKENIZER.encode(a), [-2.0, -2.0], [0, 0], r) for a, r in answers])


def test_a_same_device_update_copies_the_weights_into_the_engine() -> None:
    config = ModelConfig(max_len=32)
    engine = Engine(TinyLM(config))
    trainer = PolicyTrainer(TinyLM(config), lr=1e-2)
    try:
        trainer.step([_group()])
        report = SameDevice(engine).update(trainer.named_weights(), trainer.version)
        assert report.updated == ["in-process"] and report.timings["in-process"].version == 1
        assert engine.version == 1 and weights_digest(engine.model) == weights_digest(trainer.model)
        trained = weights_digest(trainer.model)
        trainer.step([_group()])  # the engine holds copies: the trainer's next step leaves them alone
        assert weights_digest(engine.model) == trained != weights_digest(trainer.model)
        answer = engine.submit(TOKENIZER.encode("3+4="), SamplingParams(max_tokens=2, temperature=0)).result(30)
        assert answer.versions == [1, 1]
    finally:
        engine.stop()


async def test_a_colocated_learning_run(kafka: KilnSettings, tmp_path: Path) -> None:
    config = RunConfig(name="colocated", colocate=True, steps=3, groups_per_step=4, n=4, rollout_workers=1,
                       rollout_slots=8, eval_every_s=5, deadline_s=150)
    run = LearningRun(kafka, config, tmp_path)
    record = await run.run()
    assert [u.version for _t, u in record.updates] == [1, 2, 3]
    assert all(u.servers_updated == 1 and u.servers_failed == {} for _t, u in record.updates)
    assert record.evaluations[-1].version == 3  # the server answering evaluations is the trainer's own engine
    assert record.lineage_ok and record.versions_monotonic and record.dead_letters == 0
    topics = admin.admin_client(kafka).list_topics(timeout=30).topics
    left = [t for t in topics if t.startswith(run.settings.topic_prefix)]
    assert not left  # the run deletes its topics: a broker loads every partition's log when it starts
