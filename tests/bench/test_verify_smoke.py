"""A bounded smoke run of bench/verify.py (4 prompts x 2 completions, one round): both paths — the verify stage and
the same checker calls sent straight to exec — give every verdict right and the METRIC values exist. No timing is
asserted."""

from __future__ import annotations

import pytest

from bench.verify import parse, run

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


async def test_both_paths_answer_right_and_report() -> None:
    metrics = await run(parse(["--prompts", "4", "--samples", "2", "--rounds", "1"]))
    assert metrics["verify_wrong_verdicts"] == 0
    assert metrics["verify_batch8_s"] > 0 and metrics["verify_direct_batch8_s"] > 0
    assert metrics["verify_batch8_vs_direct"] > 0
