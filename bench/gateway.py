"""SandboxFusion ``run_code`` through the gateway next to the exec stage used directly, in the same run.

- ``gateway_run_code_p50_ms`` / ``_p99_ms`` / ``gateway_run_code_rps``: a trivial python ``run_code`` over HTTP
  (``--clients`` concurrent clients, ``--requests`` each): gateway -> exec ``run_once`` (a warm runner) -> answer.
- ``exec_direct_p50_ms`` / ``_p99_ms`` / ``exec_direct_rps``: the same work with ``ExecClient`` in this process —
  ``run_once`` of ``python3 -c 'print(1)'`` on the toolchain image.
- ``gateway_overhead_fraction``: (gateway p50 - direct p50) ÷ gateway p50 (aim ≤ 0.10).
Phases alternate (direct, gateway, direct, gateway) so drift hits both sides alike.
Usage: python -m bench.gateway [--clients 4] [--requests 25]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from bench.common import broker, median, percentile, report
from kiln.integrations.gateway.settings import GatewaySettings
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.exec.client import ExecClient
from tests.integrations.gateway.conftest import gateway_process


async def measure(clients: int, requests: int, one: Callable[[], Awaitable[None]]) -> tuple[list[float], float]:
    latencies: list[float] = []

    async def client() -> None:
        for _ in range(requests):
            t = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, len(latencies) / (time.perf_counter() - started)


async def run(settings: KilnSettings, url: str, args: argparse.Namespace) -> dict[str, float]:
    image = GatewaySettings().toolchain_image
    async with KilnClient(settings, f"bench-{uuid.uuid4().hex[:6]}") as kiln, httpx.AsyncClient(timeout=120) as http:
        direct = ExecClient(kiln)

        async def through_gateway() -> None:
            answer = (await http.post(f"{url}/run_code", json={"code": "print(1)", "language": "python"})).json()
            assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "1\n", answer

        async def through_exec() -> None:
            output = (await direct.run_once(image, "python3 -c 'print(1)'")).output
            assert output is not None and output.exit_code == 0 and output.stdout == "1\n", output

        paths: dict[str, Callable[[], Awaitable[None]]] = {"direct": through_exec, "gateway": through_gateway}
        for one in paths.values():
            await measure(1, 3, one)  # warm every path
        lat: dict[str, list[float]] = {name: [] for name in paths}
        rps: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(2):
            for name, one in paths.items():
                values, rate = await measure(args.clients, args.requests, one)
                lat[name] += values
                rps[name].append(rate)
    gw, ex = median(lat["gateway"]), median(lat["direct"])
    return {
        "gateway_run_code_p50_ms": round(gw * 1000, 1),
        "gateway_run_code_p99_ms": round(percentile(lat["gateway"], 0.99) * 1000, 1),
        "gateway_run_code_rps": round(sum(rps["gateway"]) / len(rps["gateway"]), 2),
        "exec_direct_p50_ms": round(ex * 1000, 1),
        "exec_direct_p99_ms": round(percentile(lat["direct"], 0.99) * 1000, 1),
        "exec_direct_rps": round(sum(rps["direct"]) / len(rps["direct"]), 2),
        "gateway_overhead_fraction": round((gw - ex) / gw, 3),
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=25)
    args = parser.parse_args()
    run_steps(COMPONENT_STEPS["docker"])
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    topics = [TopicSpec("exec.requests", 4), TopicSpec("exec.requests.dlq", 1), TopicSpec("kiln.results", 4)]
    admin.create_topics(settings, topics)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            worker = WorkerProcess("exec", settings, "exec.requests", slots=8, env={
                "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_EXEC_WARM": "4",
                "KILN_EXEC_LOCK_DIR": str(Path(tmp) / "locks"), "KILN_METRICS_PORT": str(free_port())})
            try:
                worker.wait_assigned()
                with gateway_process(settings, Path(tmp) / "gateway.log") as url:
                    metrics = await run(settings, url, args)
            finally:
                worker.stop()
    finally:
        admin.delete_topics(settings, [settings.topic(t.name) for t in topics])
    report("gateway: SandboxFusion run_code vs the exec stage directly", metrics)


if __name__ == "__main__":
    asyncio.run(main())
