"""A bounded run of bench/cluster.py (the 5-minute storm with exec and verify lives in the bench): sleep jobs from two
clients on a three-node cluster of the storm's own, its workers SIGKILLed, one node SIGKILLed and restarted, then
one lost for good — nothing lost, nothing delivered twice, no stage halted, and progress back within the broker
session timeout plus the controller's election time after each kill; the cluster is stopped afterwards."""

from __future__ import annotations

import socket

from bench.cluster import parse, run

PORT = 29292  # nodes on 29292, 29302, 29312 (+1..+3 each): beside test_kafka_cluster's 29192


async def test_a_short_storm_on_a_cluster_loses_nothing_and_stalls_within_the_bound() -> None:
    args = parse(["--port", str(PORT), "--metrics-ports", "29500", "--exec-workers", "0", "--workers", "2",
                  "--broker-kills", "1", "--no-rolling-restart", "--no-pause", "--warmup-s", "3", "--down-s", "2",
                  "--tail-s", "5", "--seconds", "0", "--worker-kill-every", "4", "--settle", "60"])
    metrics = await run(args)
    assert metrics["cluster_broker_kills"] == 2 and metrics["cluster_worker_kills"] >= 2
    assert metrics["cluster_requests"] > 100
    assert metrics["cluster_lost_results"] == 0
    assert metrics["cluster_duplicate_deliveries"] == 0
    assert metrics["cluster_duplicate_results_one_run"] == 0
    assert metrics["cluster_stage_halts"] == 0
    assert metrics["cluster_stall_s_max"] <= metrics["cluster_stall_bound_s"]
    for port in (PORT, PORT + 10, PORT + 20):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"the storm's node on {port} is still running"
