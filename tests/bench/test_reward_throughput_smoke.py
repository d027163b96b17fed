"""A bounded smoke run of bench/reward_throughput.py (``--quick``: a few calls at concurrency 4): every path — bare
chroot (asyncio and a thread pool), docker exec, the gateway through the unmodified SandboxFusion client (async, and
its sync ``run_code`` in a thread pool as verl drives it), ExecCheck, the TRL reward, the C++ and pytest cases —
answers every call right and prints its METRIC lines, CPU per call by process among them. No timing is asserted."""

from __future__ import annotations

import pytest

from bench.reward_throughput import parse, run

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]


async def test_every_reward_path_answers_right_and_reports() -> None:
    metrics = await run(parse(["--quick"]))
    for path in ("bare", "baresync", "docker_exec", "gateway", "gatewaysync", "execcheck", "trl"):
        for what in ("calls_per_s", "p50_s", "p99_s", "cpu_ms_total"):
            assert metrics[f"reward_{path}_{what}_c4"] > 0, (path, what)
        assert metrics[f"reward_{path}_errors_c4"] == 0, path
    for path in ("baresync", "gateway", "gatewaysync", "execcheck", "trl", "docker_exec"):
        for what in ("vs_bare", "cpu_ms_sandbox_over_bare", "cpu_ms_total_over_bare"):
            assert f"reward_{path}_{what}_c4" in metrics, (path, what)
    for path in ("gateway", "gatewaysync"):  # the sandboxes ran the programs; kiln's processes carried them
        for part in ("sandbox", "kiln", "worker", "gateway", "broker"):
            assert metrics[f"reward_{path}_cpu_ms_{part}_c4"] > 0, (path, part)
    assert metrics["reward_bare_cpu_ms_children_c4"] > 0
    assert metrics["reward_idle_cpu_ms_per_s_machine"] > 0
    for case, path in (("cpp", "gateway"), ("pytest", "runonce")):
        for side in ("bare", path):
            assert metrics[f"reward_{case}_{side}_calls_per_s_c4"] > 0, (case, side)
            assert metrics[f"reward_{case}_{side}_errors_c4"] == 0, (case, side)
        assert f"reward_{case}_{path}_vs_bare_c4" in metrics
    assert metrics["reward_exec_worker_slots"] >= 1
