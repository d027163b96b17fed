"""A bounded run of bench/nodes.py: two worker nodes (each its own network namespace, Docker engine, egress proxy and
packet filter, with an exec, a build and a Lean worker) share a broker, S3 and the registry over the nodes' bridge.
The sandbox image and the builders' base images reach each engine only by digest from the registry; a sandbox on
either node reaches neither the host's broker, S3 and registry, nor the other node, nor the internet, and through
its node's proxy only a package registry; a revision built on one node runs on the other; Lean requests are
answered on both; one repository's sessions gather on one node and spill to the other; that node is then killed
whole with calls and Lean requests in flight — they replay on the other node and complete, its sessions answer
SessionLost, and once it is back its leftovers are reaped. The scenario's broker is stopped and the nodes removed
afterwards. (A build in flight at the kill, replayed elsewhere and its containers reaped, is the bench's: it costs
a minute of build.)"""

from __future__ import annotations

import asyncio
import socket

import pytest

from bench.nodes import NODES_SH, parser, run, script

KAFKA_PORT = 19692  # its own broker (19292 is test_reply_outage's)


# On a fresh machine the first run pushes the toolchain's layers to the scenario's registry and each node pulls
# them (minutes); warm, the nodes' disks hold them.
@pytest.mark.timeout(1200)
async def test_a_node_lost_whole_loses_nothing_and_leaks_nothing() -> None:
    args = parser().parse_args(["--nodes", "2", "--calls", "8", "--call-s", "4", "--lean-requests", "2",
                                "--lean-s", "5", "--no-kill-build", "--settle", "45",
                                "--kafka-port", str(KAFKA_PORT), "--s3-port", "19470", "--registry-port", "19500"])
    metrics = await run(args)
    assert metrics["nodes_pulled_by_digest"] == 2
    assert metrics["nodes_bases_by_digest"] >= 1
    assert metrics["nodes_egress_escapes"] == 0
    assert metrics["nodes_egress_proxy_allowed"] == 2
    assert metrics["nodes_built_here_ran_there"] == 1
    assert metrics["nodes_lean_answered"] == 4
    assert metrics["nodes_affinity_ok"] == 1
    assert metrics["nodes_spilled_to_other_node"] == 1
    assert metrics["nodes_lost_requests"] == 0
    assert metrics["nodes_duplicate_answers"] == 0
    assert metrics["nodes_lean_replayed"] >= 1
    assert metrics["nodes_sessions_lost_answered"] >= 1 and metrics["nodes_sessions_hung"] == 0
    assert metrics["nodes_leftovers_on_return"] >= 1 and metrics["nodes_leaked_containers"] == 0
    assert metrics["nodes_takeover_s"] > 0
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", KAFKA_PORT)) != 0, "the scenario's broker is still running"
    status = await asyncio.to_thread(script, NODES_SH, "status")
    assert status.strip() == "no nodes", status
