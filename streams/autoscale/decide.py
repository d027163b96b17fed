"""The scaling decision, a pure function of one tick's numbers (so every logged decision can be recomputed).

The rule of Harmonic's REPL service (Harmonic's article on the Lean REPL service behind its prover Aristotle): with
Lq the queue length, Rmin the completions of the last minute and Bmin the average workers over that minute, if Lq >=
Rmin the minimum is ceil((Rmin + Lq / Cm) / (Rmin / Bmin)), else 1 (CPU-based scaling takes over; here
``min_workers``, 1 by default, 0 to scale to zero). What the article leaves open:
- worker sizes differ (spare-CPU nodes run fewer slots): the rate is per slot, Rmin / (average slots over the
  minute), and the slots needed are divided by the slots a new worker brings;
- a cold start (Lq > 0 and nothing finished yet) has no rate: the slots that clear Lq in Cm minutes if a job takes
  the configured guess;
- where no CPU autoscaler runs beside it (the local backend), busy slots play its part: enough workers that the
  busy slots are at most the target utilisation of them;
- bounds: at least the minimum (≥ 0), at most the maximum; scaling up is immediate, scaling down only after
  ``down_ticks`` consecutive ticks that all wanted fewer (a queue that empties for one tick does not kill workers).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    goal_minutes: float = Field(5.0, gt=0, description="Cm: minutes to clear a non-empty queue.")
    min_workers: int = Field(1, ge=0)
    max_workers: int = Field(100, ge=1)
    slots_per_worker: int = Field(1, ge=1, description="Slots a newly started worker brings.")
    job_seconds_guess: float = Field(60.0, gt=0, description="Job time assumed before anything has finished.")
    busy_trigger: bool = Field(True, description="Also keep busy slots under the target utilisation (the local "
                                                 "backend; with KEDA its CPU trigger does this).")
    target_utilisation: float = Field(0.9, gt=0, le=1)
    down_ticks: int = Field(3, ge=1, description="Consecutive ticks wanting fewer workers before scaling down.")


class Inputs(BaseModel):
    """One stage's numbers at a tick (from ``schemas.ops.StageStats``) and the workers the backend runs now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_length: int | None
    completions_per_min: float
    workers_avg: float
    slots_avg: float
    busy_now: int
    current: int = Field(ge=0)
    down_streak: int = Field(0, ge=0, description="Earlier consecutive ticks that wanted fewer workers.")


Branch = Literal["queue", "cold-start", "cpu", "no-data"]


class Decision(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    branch: Branch
    queue_minimum: int
    busy_minimum: int
    wanted: int
    chosen: int
    down_streak: int


def queue_minimum(lq: int, rmin: float, slots_avg: float, policy: Policy) -> tuple[Branch, int]:
    if lq <= 0 or lq < rmin:
        return "cpu", policy.min_workers
    if rmin > 0 and slots_avg > 0:
        per_slot = rmin / slots_avg
        slots = (rmin + lq / policy.goal_minutes) / per_slot
        return "queue", math.ceil(_trim(slots / policy.slots_per_worker))
    slots = lq * policy.job_seconds_guess / (policy.goal_minutes * 60)
    return "cold-start", math.ceil(_trim(slots / policy.slots_per_worker))


def _trim(x: float) -> float:
    """Round away float noise before ceil (3.0000000000000004 workers is 3)."""
    return round(x, 9)


def decide(inputs: Inputs, policy: Policy) -> Decision:
    if inputs.queue_length is None:
        return Decision(branch="no-data", queue_minimum=inputs.current, busy_minimum=0, wanted=inputs.current,
                        chosen=inputs.current, down_streak=0)
    branch, by_queue = queue_minimum(inputs.queue_length, inputs.completions_per_min, inputs.slots_avg, policy)
    by_busy = (math.ceil(_trim(inputs.busy_now / (policy.slots_per_worker * policy.target_utilisation)))
               if policy.busy_trigger else 0)
    wanted = min(policy.max_workers, max(policy.min_workers, by_queue, by_busy))
    if wanted >= inputs.current:
        return Decision(branch=branch, queue_minimum=by_queue, busy_minimum=by_busy, wanted=wanted, chosen=wanted,
                        down_streak=0)
    streak = inputs.down_streak + 1
    chosen = wanted if streak >= policy.down_ticks else inputs.current
    return Decision(branch=branch, queue_minimum=by_queue, busy_minimum=by_busy, wanted=wanted, chosen=chosen,
                    down_streak=0 if chosen == wanted else streak)
