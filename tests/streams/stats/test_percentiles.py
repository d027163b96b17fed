"""Job-time percentiles from the stats stream's bucketed histogram: the reported bound is never below the true
quantile of the observed times, and at most one bucket above it."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kiln.streams.stats.app import LATENCY_BOUNDS, latency_bucket, quantile


@given(st.lists(st.floats(min_value=0, max_value=5000, allow_nan=False), min_size=1, max_size=200),
       st.sampled_from([0.5, 0.9, 0.99]))
def test_quantile_is_the_bound_of_the_true_quantiles_bucket(times: list[float], q: float) -> None:
    histogram: dict[int, float] = {}
    for t in times:
        histogram[latency_bucket(t)] = histogram.get(latency_bucket(t), 0) + 1
    reported = quantile(histogram, q)
    true = sorted(times)[max(0, math.ceil(q * len(times)) - 1)]
    assert reported is not None
    if true <= LATENCY_BOUNDS[-2]:
        assert reported >= true
        index = LATENCY_BOUNDS.index(reported)
        assert index == 0 or LATENCY_BOUNDS[index - 1] < true or reported == LATENCY_BOUNDS[latency_bucket(true)]
    else:
        assert reported == LATENCY_BOUNDS[-2]  # beyond the last finite bound: reported as that bound


def test_no_jobs_no_percentile() -> None:
    assert quantile({}, 0.5) is None and quantile({3: 0.0}, 0.99) is None
