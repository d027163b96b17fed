"""A bounded smoke run of bench/fake_zeros.py (2 prompts x 10 completions: every attack once or more, an exec
worker SIGKILLed every 15 s, the runner pool starved for 2 s): through every adapter, no right completion is scored
0, no wrong or adversarial one gets "no reward" or a 1, and every METRIC exists. The real-verdict share (≥ 0.95 in
the full run) is not asserted on a batch this small."""

from __future__ import annotations

import pytest

from bench.fake_zeros import ADAPTERS, parse, run

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


async def test_no_fake_zeros_and_no_masked_failures_under_kills() -> None:
    metrics = await run(parse(["--prompts", "2", "--samples", "10", "--timeout-s", "6", "--kill-every", "15",
                               "--starve-at", "3", "--starve-s", "2"]))
    measured = [a for a in ADAPTERS if f"reward_fake_zeros_{a}" in metrics]
    assert {"trl", "verl", "openrlhf", "areal"} <= set(measured), metrics
    for adapter in measured:
        assert metrics[f"reward_fake_zeros_{adapter}"] == 0, adapter
        assert metrics[f"reward_masked_policy_failures_{adapter}"] == 0, adapter
        assert metrics[f"reward_wrong_scored_1_{adapter}"] == 0, adapter
        assert 0 < metrics[f"reward_real_verdict_share_{adapter}"] <= 1, adapter
    assert metrics["reward_exec_workers_killed"] >= 1 and metrics["reward_batch_completions"] == 20
