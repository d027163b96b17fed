"""Queue mode's slot gate (on the event loop) serves records in arrival order, and a record that waited too long
is not started."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from kiln.streams.share import LoopSlots, may_start


async def test_waiters_get_slots_in_arrival_order() -> None:
    slots = LoopSlots(1)
    await slots.acquire()
    served: list[int] = []

    async def wait(i: int) -> None:
        await slots.acquire()
        served.append(i)
        await asyncio.sleep(0.001)
        slots.release()

    waiters = [asyncio.create_task(wait(i)) for i in range(8)]
    await asyncio.sleep(0.01)
    late = asyncio.create_task(wait(99))  # arrives after the others: served last, though slots free up meanwhile
    slots.release()
    await asyncio.wait_for(asyncio.gather(*waiters, late), 5)
    assert served == [*range(8), 99]


async def test_a_waiter_gives_up_its_turn_without_losing_a_slot() -> None:
    slots = LoopSlots(1)
    await slots.acquire()
    waiter = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0)
    slots.release()
    await asyncio.wait_for(slots.acquire(), 1)  # the slot is still there
    handed = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0.01)
    slots.release()  # hands the slot to ``handed``...
    handed.cancel()  # ...which gives up in the same instant: it passes the slot on
    await asyncio.sleep(0)
    await asyncio.wait_for(slots.acquire(), 1)
    assert waiter.cancelled() and handed.cancelled()
    extra = asyncio.create_task(slots.acquire())  # one slot, held: nobody else gets in (none was made up either)
    await asyncio.sleep(0.01)
    assert not extra.done()
    extra.cancel()


@given(waited=st.floats(0, 100), job=st.floats(0.01, 100), lock=st.floats(0.1, 100))
def test_a_record_starts_only_if_it_can_finish_inside_its_lock(waited: float, job: float, lock: float) -> None:
    assert may_start(0.0, waited, lock, job) == (waited + job < lock)
    assert not may_start(0.0, waited, lock, None)
