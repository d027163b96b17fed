"""The in-process baseline of ``bench/rl.py`` (``run_in_process``): kiln's engine and ``PolicyTrainer`` in one
process, every group's sampling seeded from the run's seed as the actor seeds it (``group_seed``)."""

from __future__ import annotations

from kiln.rl.actor import group_seed
from kiln.rl.inprocess import run_in_process
from kiln.rl.local import RunConfig


def test_the_in_process_loop_trains_and_its_sampling_follows_the_runs_seed() -> None:
    config = RunConfig(steps=4, groups_per_step=8, n=8, seed=1)
    first, again = run_in_process(config), run_in_process(config)
    other = run_in_process(config.model_copy(update={"seed": 2}))
    assert len(first.steps) == 4 and first.step_ends == sorted(first.step_ends)
    assert all(s.sample_s > 0 and s.train_s > 0 and 0 <= s.reward_mean <= 1 for s in first.steps)
    # Seeded: the same seed samples (and so rewards and trains) alike, another seed differently.
    assert [s.reward_mean for s in first.steps] == [s.reward_mean for s in again.steps]
    assert [s.sampled for s in first.steps] == [s.sampled for s in again.steps]
    assert all(s.sampled != o.sampled for s, o in zip(first.steps, other.steps, strict=True))
    # A group's n samples draw from n generators of their own; groups never share one.
    assert group_seed(1, 1) - group_seed(1, 0) >= config.n and group_seed(2, 0) > group_seed(1, 10**6)
