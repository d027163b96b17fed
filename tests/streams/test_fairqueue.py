"""The fair queue's policy, simulated on a virtual clock: slot time per client, weights, no banked credit, keyed
order under any interleaving (hypothesis). The runtime's use of it on a real broker: test_fair_queueing.py."""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.streams.fairqueue import FairQueue, Queued

TP0, TP1 = ("t", 0), ("t", 1)


def simulate(queue: FairQueue[int], slots: int, duration: dict[str, float], rounds: int,
             arrivals: dict[int, list[tuple[str, int]]] | None = None) -> list[str]:
    """Run ``rounds`` time steps of 1: start jobs while slots are free, finish those whose time is up. Returns the
    clients in start order."""
    running: list[tuple[float, str, float]] = []  # (ends, client, started)
    order: list[str] = []
    for now in range(rounds):
        for client, n in (arrivals or {}).get(now, []):
            for i in range(n):
                queue.push(client, Queued(TP0, (client, now, i), 1, i), now)
        for ends, client, started in [r for r in running if r[0] <= now]:
            running.remove((ends, client, started))
            queue.finished(client, started, now)
        while len(running) < slots:
            picked = queue.pick(now, lambda _tp: True, lambda _q: True)
            if picked is None:
                break
            client, _job = picked
            queue.started(client, now)
            running.append((now + duration[client], client, now))
            order.append(client)
    return order


def test_a_trickle_behind_a_flood_gets_its_share_at_once() -> None:
    queue: FairQueue[int] = FairQueue()
    order = simulate(queue, slots=2, duration={"flood": 1, "light": 1}, rounds=12,
                     arrivals={0: [("flood", 1000), ("light", 10)]})
    light_at = [i for i, c in enumerate(order) if c == "light"]
    assert len(light_at) == 10 and light_at[-1] < 22  # one of the two slots each round, not after 1,000 jobs
    assert len(queue) == 1000 - order.count("flood")


def test_slot_time_not_job_count_is_shared() -> None:
    """Jobs 10 times longer get a tenth of the starts: equal slot-seconds."""
    queue: FairQueue[int] = FairQueue()
    order = simulate(queue, slots=1, duration={"long": 10, "short": 1}, rounds=400,
                     arrivals={0: [("long", 100), ("short", 1000)]})
    counts = Counter(order)
    assert 180 <= counts["short"] <= 220 and 18 <= counts["long"] <= 22


def test_weights_divide_slot_time() -> None:
    queue: FairQueue[int] = FairQueue(weights={"priority": 3})
    order = simulate(queue, slots=1, duration={"priority": 1, "other": 1}, rounds=400,
                     arrivals={0: [("priority", 1000), ("other", 1000)]})
    assert 295 <= Counter(order)["priority"] <= 305


def test_a_client_away_banks_no_credit() -> None:
    """Back after 100 rounds alone for the other, it shares from then on; it does not take 100 rounds back."""
    queue: FairQueue[int] = FairQueue()
    order = simulate(queue, slots=1, duration={"a": 1, "b": 1}, rounds=200,
                     arrivals={0: [("a", 1000)], 100: [("b", 1000)]})
    later = Counter(order[100:])
    assert abs(later["a"] - later["b"]) <= 2


def test_dropping_a_partition_removes_only_its_jobs() -> None:
    queue: FairQueue[int] = FairQueue()
    for i in range(5):
        queue.push("c", Queued(TP0, i, 10, i), 0)
        queue.push("c", Queued(TP1, i, 10, 100 + i), 0)
    assert sorted(j.item for j in queue.drop(TP0)) == [0, 1, 2, 3, 4]
    taken = []
    while (picked := queue.pick(0, lambda _tp: True, lambda _q: True)) is not None:
        taken.append(picked[1].item)
    assert taken == [100, 101, 102, 103, 104] and len(queue) == 0 and queue.clients == 1


def test_a_closed_partition_is_passed_over() -> None:
    queue: FairQueue[int] = FairQueue()
    queue.push("flood", Queued(TP0, 0, 1, 0), 0)
    queue.push("flood", Queued(TP1, 1, 1, 1), 0)
    picked = queue.pick(0, lambda tp: tp != TP0, lambda _q: True)
    assert picked is not None and picked[1].item == 1
    assert queue.pick(0, lambda tp: tp != TP0, lambda _q: True) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from([TP0, TP1]), st.integers(0, 3),
                          st.booleans()), min_size=1, max_size=60),
       st.integers(1, 4))
def test_a_keys_jobs_start_in_order_whatever_runs(pushes: list[tuple[str, tuple[str, int], int, bool]],
                                                  slots: int) -> None:
    """Any interleaving of clients, partitions and keys, any blocking by running keys: per (partition, key) the
    jobs start in the order they were buffered, and every job starts exactly once."""
    queue: FairQueue[int] = FairQueue(keyed=True)
    for seq, (client, tp, key, _finish) in enumerate(pushes):
        queue.push(client, Queued(tp, (tp, key), 1, seq), 0)
    busy: dict[object, tuple[str, float]] = {}
    started: dict[object, list[int]] = defaultdict(list)
    now = 0.0
    while len(queue) or busy:
        while len(busy) < slots:
            picked = queue.pick(now, lambda _tp: True, lambda q: q.key not in busy)
            if picked is None:
                break
            client, job = picked
            queue.started(client, now)
            busy[job.key] = (client, now)
            started[job.key].append(job.item)
        now += 1
        # finish the running job that started first (any policy would do: the order property must hold)
        key, (client, at) = min(busy.items(), key=lambda kv: kv[1][1])
        del busy[key]
        queue.finished(client, at, now)
    assert all(seqs == sorted(seqs) for seqs in started.values())
    assert sorted(s for seqs in started.values() for s in seqs) == list(range(len(pushes)))
    assert queue.clients == 0
