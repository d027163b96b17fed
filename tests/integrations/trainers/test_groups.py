"""``GroupBaseline``, the "no reward" of trainers that have none per sample: a real verdict answers at once; an
unjudged one waits for its group and gets the mean of the group's real verdicts, or 0 when there are none, or what
it has seen once its wait is over; a complete group is forgotten, so its key starts afresh."""

from __future__ import annotations

import asyncio
import time

import pytest

from kiln.integrations.trainers.groups import GroupBaseline
from kiln.schemas.verify import CompletionVerdict

REAL = {r: CompletionVerdict(reward=r) for r in (0.0, 0.5, 1.0)}
UNJUDGED = CompletionVerdict(reward=0.0, failure="sandbox_error", reason="runner lost")


async def test_an_unjudged_sample_gets_its_groups_mean_once_the_group_is_in() -> None:
    groups = GroupBaseline(size=4, wait_s=30)
    unjudged = asyncio.create_task(groups.reward("g", UNJUDGED))  # first to arrive: it waits for the others
    await asyncio.sleep(0.05)
    assert not unjudged.done()
    assert [await groups.reward("g", REAL[r]) for r in (1.0, 0.0, 1.0)] == [1.0, 0.0, 1.0]  # never held back
    assert await asyncio.wait_for(unjudged, 5) == pytest.approx(2 / 3)
    # The group is complete and forgotten: the key's next sample starts a new one.
    assert await groups.reward("g", REAL[0.5]) == 0.5


async def test_a_group_without_a_real_verdict_gets_a_constant() -> None:
    groups = GroupBaseline(size=2, wait_s=30)
    assert await asyncio.gather(groups.reward("g", UNJUDGED), groups.reward("g", UNJUDGED)) == [0.0, 0.0]


async def test_groups_do_not_mix() -> None:
    groups = GroupBaseline(size=2, wait_s=30)
    a, b, _, _ = await asyncio.gather(groups.reward("a", UNJUDGED), groups.reward("b", UNJUDGED),
                                      groups.reward("a", REAL[1.0]), groups.reward("b", REAL[0.0]))
    assert (a, b) == (1.0, 0.0)


async def test_a_short_group_imputes_what_it_has_after_its_wait() -> None:
    groups = GroupBaseline(size=8, wait_s=0.3)
    await groups.reward("g", REAL[0.5])
    started = time.monotonic()
    assert await groups.reward("g", UNJUDGED) == 0.5
    assert time.monotonic() - started >= 0.25
    unknown = GroupBaseline(size=0, wait_s=0.2)  # size unknown: always the full wait
    assert await asyncio.gather(unknown.reward("g", UNJUDGED), unknown.reward("g", REAL[1.0])) == [1.0, 1.0]


async def test_only_the_newest_groups_are_kept() -> None:
    groups = GroupBaseline(size=3, wait_s=0.1, keep=2)
    await groups.reward("old", REAL[1.0])
    await groups.reward("mid", REAL[1.0])
    await groups.reward("new", REAL[1.0])  # "old" is forgotten
    assert await groups.reward("old", UNJUDGED) == 0.0
