"""Queue mode's slot gate serves records in arrival order, and a record that waited too long is not started."""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from kiln.streams.share import FifoSlots, may_start


def test_waiters_get_slots_in_arrival_order() -> None:
    slots = FifoSlots(1)
    stopping = threading.Event()
    assert slots.acquire(stopping)
    served: list[int] = []

    def wait(i: int) -> None:
        assert slots.acquire(stopping)
        served.append(i)
        time.sleep(0.01)
        slots.release()

    threads = []
    for i in range(8):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        time.sleep(0.02)  # arrive one after another
    slots.release()
    for t in threads:
        t.join(10)
    assert served == list(range(8))


def test_a_waiter_gives_up_its_turn_on_stop_without_losing_a_slot() -> None:
    slots = FifoSlots(1)
    stopping = threading.Event()
    assert slots.acquire(stopping)
    gave_up: list[bool] = []
    waiter = threading.Thread(target=lambda: gave_up.append(slots.acquire(stopping, poll_s=0.01)))
    waiter.start()
    time.sleep(0.05)
    stopping.set()
    waiter.join(5)
    assert gave_up == [False]
    slots.release()
    assert slots.acquire(threading.Event())  # the slot is still there


@given(waited=st.floats(0, 100), job=st.floats(0.01, 100), lock=st.floats(0.1, 100))
def test_a_record_starts_only_if_it_can_finish_inside_its_lock(waited: float, job: float, lock: float) -> None:
    assert may_start(0.0, waited, lock, job) == (waited + job < lock)
    assert not may_start(0.0, waited, lock, None)
