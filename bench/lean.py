"""Lean stage throughput on the fake REPL (fixed tactic cost, default 5 ms): tactics per second through the broker,
how much of the slots' time goes to Lean work, and what reusing a loaded header buys.

- ``lean_tactics_per_s``: one worker (--slots), a client keeping --inflight proof walks outstanding for --seconds
  (each walks ``intro h; constructor; exact h; trivial`` from a sorry, one request per tactic, then starts over);
  replies carry state handles, a state is exported every 16 tactics (the default). ``_eager``: the same run with
  ``KILN_LEAN_EXPORT_EVERY=1`` — every new state exported on the reply path, as before handles.
- ``lean_repl_work_fraction``: the worker's own ``kiln_lean_repl_seconds_total`` for code and tactic requests (time
  inside REPL round trips doing what was asked, not exports, imports or replays) ÷ (slots * the window).
- ``lean_slot_utilization``: mean of the worker's ``kiln_busy_slots / kiln_slots`` sampled every 50 ms.
- ``lean_header_reuse_speedup``: run_code throughput with a header costing --import-s to load, pool reuse on vs.
  off (``KILN_LEAN_RECYCLE_AFTER=1``: a fresh process, hence a fresh import, per request), both over the same
  --code-requests requests. Most of it is the fake REPL's configured import sleep (a restatement of --import-s), so
  two measured figures go with it: ``lean_recycle_speedup_no_import`` (the same pair of runs with a header that
  costs nothing to load: what a fresh process per request costs by itself) and
  ``lean_no_reuse_overhead_beyond_import_s`` (seconds per request per slot without reuse, minus --import-s).
Usage: python -m bench.lean [--slots 4] [--seconds 20] [--inflight 64] [--tactic-ms 5] [--import-s 2]
                            [--code-requests 16]
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


def _gauge(text: str, name: str, labels: str = "[^}]*") -> float:
    match = re.search(rf"^{name}{{{labels}}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def _work_seconds(port: int) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    return sum(_gauge(text, "kiln_lean_repl_seconds_total", f'op="{op}"') for op in ("code", "tactic"))


async def _sample_busy(port: int, stop: asyncio.Event, samples: list[float]) -> None:
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            slots = _gauge(text, "kiln_slots")
            if slots:
                samples.append(_gauge(text, "kiln_busy_slots") / slots)
            await asyncio.sleep(0.05)


WALK = ("intro h", "constructor", "exact h", "trivial")


async def tactic_throughput(settings: KilnSettings, args: argparse.Namespace, export_every: int) -> dict[str, float]:
    port = free_port()
    worker = WorkerProcess("lean", settings, "lean.requests", slots=args.slots,
                        env={"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_LEAN_REPL": FAKE_COMMAND,
                             "FAKE_LEAN_TACTIC_MS": str(args.tactic_ms), "KILN_METRICS_PORT": str(port),
                             "KILN_LEAN_PASS_ENV": '["FAKE_LEAN_TACTIC_MS"]',
                             "KILN_LEAN_EXPORT_EVERY": str(export_every)})
    try:
        worker.wait_assigned()
        async with KilnClient(settings, f"bench-{uuid.uuid4().hex[:6]}") as kiln:
            client = LeanClient(kiln)
            for _ in range(20):  # warm the pool up to its size
                await asyncio.gather(*(client.run_code(THEOREMS) for _ in range(args.slots)))
            done = exported = 0
            deadline = time.monotonic() + args.seconds
            stop, samples = asyncio.Event(), []
            sampler = asyncio.create_task(_sample_busy(port, stop, samples))

            async def walk(i: int) -> None:
                nonlocal done, exported
                while time.monotonic() < deadline:
                    state: ProofStateRef | None = (await client.run_code(THEOREMS, key=f"k{i}")).sorries[0].state
                    for tactic in WALK:
                        assert state is not None
                        result = await client.run_tactic(state, tactic)
                        assert result.ok, result.error
                        done += 1
                        exported += bool(result.state and result.state.exported)
                        state = result.state

            work_before, started = await _work_seconds(port), time.monotonic()
            await asyncio.gather(*(walk(i) for i in range(args.inflight)))
            elapsed, work = time.monotonic() - started, await _work_seconds(port) - work_before
            stop.set()
            await sampler
    finally:
        worker.stop()
    return {"lean_tactics_per_s": round(done / elapsed, 1),
            "lean_slot_utilization": round(sum(samples) / max(1, len(samples)), 3),
            "lean_repl_work_fraction": round(work / (args.slots * elapsed), 3),
            "lean_states_exported_fraction": round(exported / max(1, done), 3)}


async def code_throughput(settings: KilnSettings, args: argparse.Namespace, reuse: bool, requests: int,
                          import_s: float) -> float:
    env = {"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_LEAN_REPL": FAKE_COMMAND,
           "FAKE_LEAN_IMPORT_S": str(import_s), "KILN_METRICS_PORT": str(free_port()),
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
    parser.add_argument("--code-requests", type=int, default=16, help="run_code requests of each header run")
    args = parser.parse_args()
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    admin.create_topics(settings, [TopicSpec("lean.requests", 8), TopicSpec("lean.requests.dlq", 1),
                                   TopicSpec("kiln.results", 4)])
    try:
        eager = asyncio.run(tactic_throughput(settings, args, export_every=1))
        metrics = asyncio.run(tactic_throughput(settings, args, export_every=16))
        metrics.update({f"{name}_eager": value for name, value in eager.items()})
        metrics["lean_tactics_per_s_vs_eager"] = round(metrics["lean_tactics_per_s"] / eager["lean_tactics_per_s"], 2)
        n = args.code_requests  # the same requests in every run: one denominator
        with_reuse = asyncio.run(code_throughput(settings, args, True, n, args.import_s))
        without = asyncio.run(code_throughput(settings, args, False, n, args.import_s))
        free_reuse = asyncio.run(code_throughput(settings, args, True, n, 0.0))
        free_without = asyncio.run(code_throughput(settings, args, False, n, 0.0))
    finally:
        admin.delete_topics(settings, [settings.topic(t) for t in ("lean.requests", "lean.requests.dlq",
                                                                    "kiln.results")])
    metrics.update({"lean_code_per_s_header_reuse": round(with_reuse, 2),
                    "lean_code_per_s_no_reuse": round(without, 3),
                    "lean_header_reuse_speedup": round(with_reuse / without, 1),
                    "lean_recycle_speedup_no_import": round(free_reuse / free_without, 2),
                    "lean_no_reuse_overhead_beyond_import_s": round(args.slots / without - args.import_s, 3)})
    report(f"Lean stage, fake REPL ({args.tactic_ms:g} ms tactics, {args.slots} slots, {args.import_s:g} s header)",
           metrics)


if __name__ == "__main__":
    main()
