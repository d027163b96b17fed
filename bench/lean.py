"""Lean stage throughput on the fake REPL (fixed tactic cost, default 5 ms): tactics per second through the broker,
how busy the worker's slots are, and what reusing a loaded header buys.

- ``lean_tactics_per_s``: one worker (--slots), a client keeping --inflight tactic requests outstanding for
  --seconds; every result carries its new exported (compressed) proof state.
- ``lean_slot_utilization``: mean of the worker's ``kiln_busy_slots / kiln_slots`` sampled every 50 ms over the
  same window; ``lean_repl_work_fraction`` is the part of slot time the REPL spent in the tactic itself.
- ``lean_header_reuse_speedup``: run_code throughput with a header costing --import-s to load, pool reuse on vs.
  off (``KILN_LEAN_RECYCLE_AFTER=1``: a fresh process, hence a fresh import, per request).
Usage: python -m bench.lean [--slots 4] [--seconds 20] [--inflight 64] [--tactic-ms 5] [--import-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
import uuid

import httpx

from bench.common import broker, report
from kiln.schemas.lean import ProofStateRef
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.lean.client import LeanClient
from tests.workers.lean.fake import FAKE_COMMAND, THEOREMS


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def _sample_busy(port: int, stop: asyncio.Event, samples: list[float]) -> None:
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            slots = _gauge(text, "kiln_slots")
            if slots:
                samples.append(_gauge(text, "kiln_busy_slots") / slots)
            await asyncio.sleep(0.05)


async def tactic_throughput(settings: KilnSettings, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    worker = WorkerProcess("lean", settings, "lean.requests", slots=args.slots,
                        env={"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_LEAN_REPL": FAKE_COMMAND,
                             "FAKE_LEAN_TACTIC_MS": str(args.tactic_ms), "KILN_METRICS_PORT": str(port),
                             "KILN_LEAN_PASS_ENV": '["FAKE_LEAN_TACTIC_MS"]'})
    try:
        worker.wait_assigned()
        async with KilnClient(settings, f"bench-{uuid.uuid4().hex[:6]}") as kiln:
            client = LeanClient(kiln)
            state: ProofStateRef = (await client.run_code(THEOREMS)).sorries[0].state
            ratios = [state.stored_bytes / state.raw_bytes]
            for _ in range(20):  # warm the pool up to its size
                await asyncio.gather(*(client.run_tactic(state, "intro h") for _ in range(args.slots)))
            done = 0
            deadline = time.monotonic() + args.seconds
            stop, samples = asyncio.Event(), []
            sampler = asyncio.create_task(_sample_busy(port, stop, samples))

            async def loop(i: int) -> None:
                nonlocal done
                moved = state.model_copy(update={"affinity": f"k{i}"})
                while time.monotonic() < deadline:
                    result = await client.run_tactic(moved, "intro h")
                    done += 1
                    if result.state and done % 50 == 0:
                        ratios.append(result.state.stored_bytes / result.state.raw_bytes)

            started = time.monotonic()
            await asyncio.gather(*(loop(i) for i in range(args.inflight)))
            elapsed = time.monotonic() - started
            stop.set()
            await sampler
    finally:
        worker.stop()
    return {"lean_tactics_per_s": round(done / elapsed, 1),
            "lean_slot_utilization": round(sum(samples) / max(1, len(samples)), 3),
            "lean_repl_work_fraction": round(done * args.tactic_ms / 1000 / (args.slots * elapsed), 3),
            "lean_state_compression_ratio": round(sum(ratios) / len(ratios), 4)}


async def code_throughput(settings: KilnSettings, args: argparse.Namespace, reuse: bool, requests: int) -> float:
    env = {"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_LEAN_REPL": FAKE_COMMAND,
           "FAKE_LEAN_IMPORT_S": str(args.import_s), "KILN_METRICS_PORT": str(free_port()),
           "KILN_LEAN_PASS_ENV": '["FAKE_LEAN_IMPORT_S"]'}
    if not reuse:
        env["KILN_LEAN_RECYCLE_AFTER"] = "1"
    worker = WorkerProcess("lean", settings, "lean.requests", slots=args.slots, env=env)
    try:
        worker.wait_assigned()
        async with KilnClient(settings, f"bench-{uuid.uuid4().hex[:6]}") as kiln:
            client = LeanClient(kiln)
            started = time.monotonic()
            await asyncio.gather(*(client.run_code(THEOREMS, header=["import Mathlib"], timeout_s=600)
                                   for _ in range(requests)))
            return requests / (time.monotonic() - started)
    finally:
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--tactic-ms", type=float, default=5)
    parser.add_argument("--import-s", type=float, default=2)
    args = parser.parse_args()
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    admin.create_topics(settings, [TopicSpec("lean.requests", 8), TopicSpec("lean.requests.dlq", 1),
                                   TopicSpec("kiln.results", 4)])
    try:
        metrics = asyncio.run(tactic_throughput(settings, args))
        with_reuse = asyncio.run(code_throughput(settings, args, True, 40))
        without = asyncio.run(code_throughput(settings, args, False, 2 * args.slots))
    finally:
        admin.delete_topics(settings, [settings.topic(t) for t in ("lean.requests", "lean.requests.dlq",
                                                                    "kiln.results")])
    metrics.update({"lean_code_per_s_header_reuse": round(with_reuse, 2),
                    "lean_code_per_s_no_reuse": round(without, 3),
                    "lean_header_reuse_speedup": round(with_reuse / without, 1)})
    report(f"Lean stage, fake REPL ({args.tactic_ms:g} ms tactics, {args.slots} slots, {args.import_s:g} s header)",
           metrics, {"compression": "fake pickles are padded JSON: the ratio is for information only"})


if __name__ == "__main__":
    main()
