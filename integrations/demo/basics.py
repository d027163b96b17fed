"""``kiln demo basics``: the runtime's tour — echo and sleep workers, a mix of jobs (a retry, a dead letter, a claim
check) through the broker, results printed as they arrive."""

from __future__ import annotations

import asyncio
import json
import random
import time

from rich.console import Console
from rich.table import Table

from kiln.schemas.builtin import EchoRequest, SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.runtime import Worker
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import load_stage


async def run_demo(settings: KilnSettings, console: Console) -> int:
    """Returns the number of results that did not match what the demo expected (0 = success)."""
    store = open_blob_store(settings)
    workers = [Worker(load_stage(name), settings, slots=4, blob_store=store, grace_s=5) for name in ("echo", "sleep")]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    await asyncio.gather(*(asyncio.to_thread(w.ready.wait, 60) for w in workers))
    console.print(f"workers up: echo and sleep, 4 slots each; metrics on ports {[w.metrics_port for w in workers]}")

    rng = random.Random(7)
    table = Table("#", "job", "status", "expected", "ms", "tries", "result / error")
    mismatches = 0
    async with KilnClient(settings, blob_store=store) as client:

        async def job(label: str, expect: str, kind: str, payload: EchoRequest | SleepRequest
                      ) -> tuple[str, str, float, ResultEnvelope]:
            t0 = time.monotonic()
            env = await (await client.submit(kind, payload))
            return label, expect, (time.monotonic() - t0) * 1000, env

        jobs = [job(f"echo {i}", "ok", "echo", EchoRequest(data={"hello": "kiln", "n": i})) for i in range(3)]
        for i in range(8):
            secs = round(rng.uniform(0.05, 1.0), 2)
            jobs.append(job(f"sleep {secs}s", "ok", "sleep", SleepRequest(seconds=secs, tag=f"s{i}")))
        jobs.append(job("fails once, retried", "ok", "sleep", SleepRequest(fail="transient", fail_attempts=1)))
        jobs.append(job("poison -> DLQ", "error", "sleep", SleepRequest(fail="permanent")))
        jobs.append(job("400 KB payload (claim check)", "ok", "echo", EchoRequest(data="x" * 400_000)))
        for n, done in enumerate(asyncio.as_completed(jobs), 1):
            label, expect, ms, env = await done
            if env.error:
                detail = f"{env.error.type}: {env.error.message}"
            else:
                detail = json.dumps(client.result_of(env).model_dump(exclude={"worker"}))
            mismatches += env.status != expect
            table.add_row(str(n), label, env.status, expect, f"{ms:.0f}", str(env.attempts), detail[:40])
    console.print(table)
    for w in workers:
        w.stop()
    await asyncio.gather(*tasks)
    console.print("[green]demo ok[/]" if not mismatches else f"[red]{mismatches} unexpected results[/]")
    return mismatches
