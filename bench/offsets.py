"""Offset tracking with a deep finished-ahead tail: one long job low in a partition, many finished behind it.

For each depth (0 = baseline, 10k, 100k finished jobs behind the one pending job) it measures, on the tracker the
runtime and the client use: the time of each of the next 5,000 ``finish`` calls (p99), and of building one commit
(``commit_position``: committable offset + encoded finished-ahead map; median of 200). Ratios are against depth 0
in the same run.
Prints ``offsets_finish_us_p99_<depth>``, ``offsets_commit_ms_<depth>``, ``offsets_finish_ratio_100k``,
``offsets_commit_ratio_100k``.
Usage: python -m bench.offsets
"""

from __future__ import annotations

import time

from bench.common import median, percentile, report
from kiln.streams.offsets import PartitionOffsets, commit_position

MEASURED = 5_000


def measure(depth: int) -> tuple[float, float]:
    """(p99 finish in µs, median commit build in ms) with ``depth`` jobs finished behind a pending one."""
    tracker = PartitionOffsets(0)
    for o in range(depth + MEASURED + 1):
        tracker.receive(o)
    for o in range(1, depth + 1):
        tracker.finish(o)
    finishes = []
    for o in range(depth + 1, depth + MEASURED + 1):
        t = time.perf_counter_ns()
        tracker.finish(o)
        finishes.append((time.perf_counter_ns() - t) / 1000)
    commits = []
    for _ in range(200):
        t = time.perf_counter_ns()
        position = commit_position("t", 0, tracker)
        commits.append((time.perf_counter_ns() - t) / 1e6)
    assert position.offset == 0 and tracker.finished_ahead == depth + MEASURED
    return percentile(finishes, 0.99), median(commits)


def main() -> None:
    metrics: dict[str, float] = {}
    for depth, label in ((0, "0"), (10_000, "10k"), (100_000, "100k")):
        finish_us, commit_ms = measure(depth)
        metrics[f"offsets_finish_us_p99_{label}"] = round(finish_us, 2)
        metrics[f"offsets_commit_ms_{label}"] = round(commit_ms, 4)
    metrics["offsets_finish_ratio_100k"] = round(metrics["offsets_finish_us_p99_100k"]
                                                 / metrics["offsets_finish_us_p99_0"], 2)
    metrics["offsets_commit_ratio_100k"] = round(metrics["offsets_commit_ms_100k"] / metrics["offsets_commit_ms_0"], 2)
    report("offset tracking with a deep finished-ahead tail", metrics)


if __name__ == "__main__":
    main()
