"""One training step's rewards through the ``verify`` stage, next to the same checks sent straight to the exec stage
(issue 36).

The batch: ``--prompts`` (64) digit additions x ``--samples`` (8) completions = 512, each prompt's completions one
group, checked by the addition checker (``kiln.rl.tasks.ADDITION_CHECKER``, an ``exec`` task on
``kiln/toolchain:latest``). Two paths, alternating ``--rounds`` times after a warm-up of each:

- ``verify``: ``VerifyClient.verify_batch`` — the step's groups (one per prompt) in one verify request; the verify
  worker's exec verifier batches them into checker calls (up to ``KILN_VERIFY_EXEC_BATCH_GROUPS``, 32, per call).
- ``direct``: the same checks by hand on the exec stage — the groups chunked the same way (32 per call), one
  ``ExecClient.run_once`` per chunk with the same checker and ``groups.jsonl``, all in flight, outputs parsed.

METRIC ``verify_batch512_s`` (median over rounds: the batch's wall time, submit to last verdict),
``verify_direct_batch512_s`` and ``verify_batch512_vs_direct`` (their ratio; aim ≤ 1.2),
``verify_batch512_overhead_s`` (their difference: what the verify stage adds — two more broker hops, client →
verify worker and back, and the work of one more request and result, on the client and the verify worker; its
batching holds no step back: a step's calls go as soon as its groups have joined them — a cost that does not grow
with the checks, so the ratio falls as checks take longer),
``verify_wrong_verdicts``
(verdicts that differ from the in-process answer; must be 0). Workers: one exec worker (its default slots) and one
verify worker, on this machine.

``--check-s`` makes every checker call take that much longer in its sandbox (a costlier check, same batching).

Usage: python -m bench.verify [--prompts 64] [--samples 8] [--rounds 5] [--check-s 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import broker, console, report
from kiln.rl.tasks import Addition
from kiln.schemas.rl import RolloutTask
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.stage import TopicSpec
from kiln.workers.exec.client import ExecClient
from kiln.workers.verifiers import ExecCheck, exact_match
from kiln.workers.verify.client import VerifyClient

IMAGE = "kiln/toolchain:latest"
BATCH_GROUPS = 32  # the verify stage's default exec batch: the direct path chunks the same way


def batch(prompts: int, samples: int, seed: int, check_s: float = 0.0) -> tuple[list[RolloutTask], list[str]]:
    rng = random.Random(seed)
    source = Addition(digits=2, exec_image=IMAGE)
    tasks, completions = [], []
    for _ in range(prompts):
        a, b = rng.randrange(100), rng.randrange(100)
        task = source.task(a, b)
        if check_s:  # a checker that takes that long in its sandbox
            command = f"sleep {check_s}; {task.check['command']}"
            task = task.model_copy(update={"check": {**task.check, "command": command}})
        for _ in range(samples):
            tasks.append(task)
            completions.append(str(a + b + rng.choice((0, 0, 1, -1))))  # about half right
    return tasks, completions


async def via_verify(client: VerifyClient, tasks: list[RolloutTask], completions: list[str]) -> list[float]:
    return [v.reward for v in await client.verify_batch(tasks, completions)]


async def direct(exec_client: ExecClient, tasks: list[RolloutTask], completions: list[str]) -> list[float]:
    """The same checker, groups and chunking as the verify worker, sent to the exec stage by hand."""
    groups: dict[str, tuple[RolloutTask, list[int]]] = {}
    for i, task in enumerate(tasks):
        groups.setdefault(task.task_id, (task, []))[1].append(i)
    ordered = list(groups.values())
    check = ExecCheck.model_validate(ordered[0][0].check)

    async def call(chunk: list[tuple[RolloutTask, list[int]]]) -> list[list[float]]:
        lines = "".join(json.dumps({"task_id": t.task_id, "prompt": t.prompt, "answer": t.answer,
                                    "completions": [completions[i] for i in at]}) + "\n" for t, at in chunk)
        files = {f".kiln-check/{name}": text for name, text in {**check.files, "groups.jsonl": lines}.items()}
        result = await exec_client.run_once(check.image, check.command, files=files, cwd=".kiln-check",
                                            timeout_s=check.timeout_s, max_output_bytes=4 << 20)
        assert result.output is not None and result.output.exit_code == 0, result.output
        return [[float(v["reward"]) for v in json.loads(line)["verdicts"]]
                for line in result.output.stdout.splitlines() if line.strip()]

    chunks = [ordered[i:i + BATCH_GROUPS] for i in range(0, len(ordered), BATCH_GROUPS)]
    answers = await asyncio.gather(*(call(chunk) for chunk in chunks))
    rewards = [0.0] * len(completions)
    for chunk, verdicts in zip(chunks, answers, strict=True):
        for (_, at), group in zip(chunk, verdicts, strict=True):
            for i, reward in zip(at, group, strict=True):
                rewards[i] = reward
    return rewards


async def run(args: argparse.Namespace) -> dict[str, float]:
    run_steps(COMPONENT_STEPS["docker"])
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    names = ("exec.requests", "verify.requests")
    admin.create_topics(settings, [TopicSpec("kiln.results", 4), *(TopicSpec(n, 8) for n in names),
                                   *(TopicSpec(f"{n}.dlq", 1) for n in names)])
    tasks, completions = batch(args.prompts, args.samples, args.seed, args.check_s)
    expected = [exact_match(t, c) for t, c in zip(tasks, completions, strict=True)]
    times: dict[str, list[float]] = {"verify": [], "direct": []}
    wrong = 0
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-bench-verify-")))
        env = {k: v for k, v in os.environ.items() if k != "KILN_SLOTS"}
        env.update({"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache)})
        ex = stack.enter_context(WorkerProcess("exec", settings, "exec.requests", slots=0, env={
            **env, "KILN_EXEC_LOCK_DIR": str(tmp / "locks"), "KILN_METRICS_PORT": str(free_port())}))
        ver = stack.enter_context(WorkerProcess("verify", settings, "verify.requests", slots=64, env={
            **env, "KILN_METRICS_PORT": str(free_port())}))
        ex.wait_assigned(120)
        ver.wait_assigned(120)
        async with KilnClient(settings, f"bench-verify-{uuid.uuid4().hex[:6]}") as kiln:
            paths = {"verify": lambda: via_verify(VerifyClient(kiln), tasks, completions),
                     "direct": lambda: direct(ExecClient(kiln), tasks, completions)}
            for name, path in paths.items():  # warm: runners started, topics and connections used
                await path()
                console.print(f"warmed {name}")
            for r in range(args.rounds):
                for name, path in (paths.items() if r % 2 == 0 else reversed(paths.items())):
                    started = time.perf_counter()
                    rewards = await path()
                    times[name].append(time.perf_counter() - started)
                    wrong += sum(1 for got, want in zip(rewards, expected, strict=True) if got != want)
                    console.print(f"round {r + 1} {name}: {times[name][-1]:.3f} s")
    n = len(completions)
    verify_s, direct_s = statistics.median(times["verify"]), statistics.median(times["direct"])
    return {f"verify_batch{n}_s": verify_s, f"verify_direct_batch{n}_s": direct_s,
            f"verify_batch{n}_vs_direct": verify_s / direct_s, f"verify_batch{n}_overhead_s": verify_s - direct_s,
            "verify_wrong_verdicts": float(wrong)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-s", type=float, default=0.0, help="extra sandbox time of each checker call")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    report("verify: one training step's batch, through the verify stage and straight to exec",
           asyncio.run(run(args)))


if __name__ == "__main__":
    main()
