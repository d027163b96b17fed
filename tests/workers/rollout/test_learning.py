"""The learning loop end to end, every part its own process (broker, inference server, exec workers, rollout
workers, trainer, actor): greedy accuracy on held-out prompts rises by at least 0.15 within the run's bound with
every reward computed by the exec stage in sandboxes, while the trainer and a rollout worker are SIGKILLed mid-run —
the run goes on, the committed checkpoint's lineage trains every rollout before the committed offsets exactly once,
and the policy version the server answers with never goes back. (The longer async-vs-sync comparison is
bench/rl.py.)

Why 0.15 and not the 0.25 of the learning-loop issue: from scratch on 2 shared cores, the rise inside the 530 s
bound varied from 0.21 to 0.30 across four CI runs (two ended at 0.21 and 0.24), so 0.25 failed half the time;
0.15 still needs the policy to leave the early 0.10 plateau, which a loop that does not learn never does. The 0.25
claim is measured by bench/rl.py, without the CI bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.streams.settings import KilnSettings
from kiln.workers.rollout.local import LearningRun, RunConfig

pytestmark = pytest.mark.docker


@pytest.mark.timeout(600)
async def test_accuracy_rises_with_exec_rewards_through_kills(kafka: KilnSettings, project_image: str,
                                                              tmp_path: Path) -> None:
    config = RunConfig(name="e2e", steps=300, target=0.3, deadline_s=530, exec_image=project_image, seed=1,
                       kill_trainer_at=12, kill_rollout_at=24, eval_every_s=15)
    record = await LearningRun(kafka, config, tmp_path).run()
    first, last = record.evaluations[0], record.evaluations[-1]
    trace = [(round(e.t), e.version, e.accuracy) for e in record.evaluations]
    assert last.accuracy - first.accuracy >= 0.15, trace
    assert record.kills == ["trainer", "rollout"], trace
    assert record.lineage_ok and record.trained_groups >= 24 * config.groups_per_step
    assert record.versions_monotonic, trace
    assert record.dead_letters == 0
    assert set(record.verified_by) == {"exec"} and record.verified_by["exec"] == record.rollouts * config.n
