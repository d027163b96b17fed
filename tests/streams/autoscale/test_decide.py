"""The decision function on its own: the formula of Harmonic's REPL service where its article defines it, and the
cases it leaves open."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kiln.streams.autoscale.backends import KedaBackend
from kiln.streams.autoscale.decide import Inputs, Policy, decide
from kiln.streams.autoscale.loop import Autoscaler

SEED = Policy(goal_minutes=5, max_workers=10_000, busy_trigger=False)


def inputs(lq: int | None, rmin: float, bmin: float, slots_per_worker: int = 1, **kw: int) -> Inputs:
    return Inputs(queue_length=lq, completions_per_min=rmin, workers_avg=bmin, slots_avg=bmin * slots_per_worker,
                  busy_now=kw.pop("busy", 0), current=kw.pop("current", 1), **kw)


@given(st.integers(1, 1_000_000), st.floats(0.5, 10_000), st.floats(0.1, 500))
def test_a_queue_that_takes_over_a_minute_gets_the_seeds_minimum(lq: int, rmin: float, bmin: float) -> None:
    decision = decide(inputs(lq, rmin, bmin), SEED)
    if lq >= rmin:
        seed = math.ceil(round((rmin + lq / SEED.goal_minutes) / (rmin / bmin), 9))
        assert decision.branch == "queue" and decision.queue_minimum == seed
        assert decision.chosen == min(SEED.max_workers, max(1, seed))
    else:
        assert decision.branch == "cpu" and decision.queue_minimum == 1


def test_worker_sizes_count_as_slots() -> None:
    # 2 workers of 4 slots cleared 80/min; the same rate per slot with 8-slot workers needs half the workers.
    small = decide(inputs(800, 80, 2, slots_per_worker=4), Policy(slots_per_worker=4, busy_trigger=False))
    big = decide(inputs(800, 80, 2, slots_per_worker=4), Policy(slots_per_worker=8, busy_trigger=False))
    assert small.queue_minimum == 2 * big.queue_minimum == math.ceil((80 + 800 / 5) / (80 / 8) / 4) * 1


def test_cold_start_scales_by_the_job_time_guess() -> None:
    decision = decide(inputs(600, 0, 0), Policy(job_seconds_guess=30, goal_minutes=5, slots_per_worker=2))
    assert decision.branch == "cold-start" and decision.chosen == math.ceil(600 * 30 / 300 / 2)


def test_maximum_minimum_and_no_data() -> None:
    assert decide(inputs(10**9, 10, 1), Policy(max_workers=7)).chosen == 7
    assert decide(inputs(0, 0, 0, current=0), Policy(min_workers=0)).chosen == 0
    assert decide(inputs(None, 0, 0, current=4), Policy()).chosen == 4


def test_busy_slots_keep_workers_where_no_cpu_autoscaler_runs() -> None:
    assert decide(inputs(0, 100, 4, busy=18, current=5), Policy(slots_per_worker=4)).chosen == 5  # 18/(4*.9)
    assert decide(inputs(0, 100, 4, busy=18, current=5), Policy(slots_per_worker=4, busy_trigger=False)
                  ).down_streak == 1


def test_scale_down_waits_for_consecutive_ticks_scale_up_does_not() -> None:
    policy = Policy(down_ticks=3)
    streak, chosen = 0, []
    for _ in range(3):
        d = decide(inputs(0, 50, 6, current=6, down_streak=streak), policy)
        streak = d.down_streak
        chosen.append(d.chosen)
    assert chosen == [6, 6, 1]
    interrupted = decide(inputs(10_000, 50, 6, current=6, down_streak=2), policy)
    assert interrupted.chosen > 6 and interrupted.down_streak == 0


def test_the_audit_recomputes_and_catches_a_scaler_that_jumps_to_its_maximum() -> None:
    policy = Policy(max_workers=50, down_ticks=2)
    entries, streak = [], 0
    for lq in (400, 300, 0, 0, 0):
        i = inputs(lq, 120, 2, current=3, down_streak=streak)
        d = decide(i, policy)
        streak = d.down_streak
        entries.append({"stage": "s", "inputs": i.model_dump(), "decision": d.model_dump(),
                        "policy": policy.model_dump()})
    assert Autoscaler.audit(entries) == []
    greedy = [{**e, "decision": {**e["decision"], "chosen": 50, "wanted": 50}} for e in entries]
    assert len(Autoscaler.audit(greedy)) == len(entries)


def test_the_keda_minimum_comes_down_while_the_pods_still_run() -> None:
    """KEDA's pods outlive the minimum that raised them (the HPA's scale-down window, its CPU trigger): the minimum
    the autoscaler serves, once lowered after ``down_ticks``, stays low; it never echoes the running pods back (on a
    real cluster that held exec at 3 pods long after its queue drained: the minimum was 1 for one tick in three)."""
    backend, policy = KedaBackend(), Policy(down_ticks=3, busy_trigger=False)
    backend.seen["exec"] = 3  # heartbeats: three pods alive, and they stay until Kubernetes removes them
    served, streak = [], 0
    for _ in range(8):
        d = decide(inputs(0, 0, 3, current=backend.current("exec"), down_streak=streak), policy)
        backend.scale("exec", d.chosen)
        streak = d.down_streak
        served.append(backend.desired["exec"])
    assert served == [3, 3, 1, 1, 1, 1, 1, 1]
    rising = decide(inputs(500, 0, 3, current=backend.current("exec")), policy)
    assert rising.chosen > 1 and rising.branch == "cold-start"
