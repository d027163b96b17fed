"""A bounded smoke run of bench/chaos.py (the 5-minute storm lives in the bench): kills, a results topic refusing
writes, a broker restart on the storm's own broker, a client restart, poison of every class, a client with a skewed
clock and a results topic re-created under a client lose nothing, deliver nothing twice (across the client's two
lives), expire nothing for the skew and never halt the stage; the storm's broker is stopped afterwards."""

from __future__ import annotations

import argparse
import socket

from bench.chaos import run

PORT = 19192


async def test_a_short_storm_loses_nothing_and_never_halts() -> None:
    args = argparse.Namespace(seconds=24, kill_every=4, workers=2, slots=4, rate=15, poison_share=0.05, settle=90,
                              port=PORT, results_outage=3)
    metrics = await run(args)
    assert metrics["chaos_kills"] >= 3 and metrics["chaos_poison_messages"] >= 1 and metrics["chaos_requests"] > 100
    assert metrics["chaos_lost_results"] == 0
    assert metrics["chaos_duplicate_deliveries"] == 0
    assert metrics["chaos_stage_halts"] == 0
    assert metrics["chaos_skewed_expired"] == 0
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", PORT)) != 0, "the storm's broker is still running"
