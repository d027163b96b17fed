"""Fake zeros under preemption (issue 49): one reward batch with known answers through every trainer adapter while
exec workers are SIGKILLed and the runner pool is starved, counting what each trainer would have been told.

The batch: ``--prompts`` (64) a+b prompts x ``--samples`` (8) completions = 512, each prompt's completions one
group, checked by the ``program`` verifier: the completion's program on the prompt's stdin, with ``--timeout-s`` (10)
of wall time, 256 MB, 64 pids and a quarter of a CPU, ``--exec-slots`` (8) sandboxes per exec worker. A time limit
is wall time: on a loaded machine a right program needs seconds of it, and a right program past its time is a real
0 (see docs/security.md). Per group: half right programs (expected reward 1), 2 wrong ones (print a+b+1) and the rest
adversarial, the kinds in turn: a fork bomb (until the pids limit, until its time), a memory bomb (until the OOM
killer or a MemoryError), the right answer then 8 MB of newlines (a flood: stdout past the cap, whose text without
its trailing whitespace is right), the right answer then ``killpg`` of its own process group, the right answer printed
after closing its stdout. Every wrong and adversarial completion must get a real verdict of 0.

Each adapter runs the whole batch, all five at once, as its trainer calls it: ``trl`` (``Verified``, through the
verify stage), ``verl`` (``compute_score_batch``; its ``kiln_failure``), ``openrlhf`` (one gateway request per
sample, as OpenRLHF's executor sends them; ``extra_logs.kiln_failed``), ``areal`` (``async_reward_fn``;
``NoReward``) and ``prime`` (``KilnTask.score``; ``vf.SandboxError``; only where ``verifiers`` is installed: ``kiln
setup trainers``). Meanwhile every ``--kill-every`` seconds one of ``--exec-workers`` exec workers is SIGKILLed and
replaced (its jobs replay elsewhere after the group's session timeout), and at ``--starve-at`` seconds, for
``--starve-s``, every runner container of the bench's exec workers is removed as fast as they appear (calls in
flight lose their runner, new ones cannot start one: the exec stage dead-letters them, kiln's failure, which the
verify client retries: ``KILN_VERIFY_RETRY_*``, defaults).

METRIC per adapter: ``reward_fake_zeros_<adapter>`` (right completions given a real 0; must be 0),
``reward_masked_policy_failures_<adapter>`` (wrong or adversarial completions given "no reward" instead of 0; must be
0), ``reward_real_verdict_share_<adapter>`` (completions with a real verdict; aim ≥ 0.95),
``reward_wrong_scored_1_<adapter>`` (wrong or adversarial completions given 1: a reward hack; must be 0); and
``reward_exec_workers_killed``, ``reward_runners_removed``, ``reward_batch_s``.

Usage: python -m bench.fake_zeros [--prompts 64] [--samples 8] [--kill-every 20] [--starve-at 25] [--starve-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import kiln.integrations.trainers as trainers
from bench.common import broker, console, report
from kiln.integrations.trainers.areal import async_reward_fn
from kiln.integrations.trainers.errors import NoReward
from kiln.integrations.trainers.trl import Verified
from kiln.integrations.trainers.verl import compute_score_batch
from kiln.schemas.rl import RolloutTask
from kiln.streams import admin
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.common.containers import docker_client
from tests.integrations.gateway.conftest import gateway_process
from tests.integrations.trainers.conftest import importable

IMAGE = "kiln/toolchain:latest"
READ = "a, b = map(int, input().split())\n"
PROGRAMS = {
    "right": READ + "print(a + b)\n",
    "wrong": READ + "print(a + b + 1)\n",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(b'x' * (16 << 20))\n",
    "flood_after_answer": READ + "import sys\nprint(a + b)\nsys.stdout.write('\\n' * (8 << 20))\n",
    "killpg": READ + "import os, signal\nprint(a + b, flush=True)\nos.killpg(0, signal.SIGKILL)\n",
    "close_stdout": READ + "import os\nos.close(1)\nprint(a + b)\n",
}
ADVERSARIAL = ("fork_bomb", "memory_bomb", "flood_after_answer", "killpg", "close_stdout")
ADAPTERS = ("trl", "verl", "openrlhf", "areal", "prime")


@dataclass
class Case:
    task: RolloutTask
    kind: str
    completion: str

    @property
    def label(self) -> dict[str, Any]:
        """The dataset label an adapter reads (``task_of``): the kiln task's fields."""
        return self.task.model_dump()


def batch(prompts: int, samples: int, timeout_s: float, seed: int) -> list[Case]:
    """``prompts`` groups of ``samples``: half right, 2 wrong, the rest adversarial (kinds in turn)."""
    rng = random.Random(seed)
    cases, turn = [], 0
    for g in range(prompts):
        a, b = rng.randrange(-10**6, 10**6), rng.randrange(10**6)
        task = RolloutTask(task_id=f"sum-{g}", prompt=f"{a} {b}", verifier="program",
                           check={"expected_output": str(a + b), "stdin": f"{a} {b}\n", "timeout_s": timeout_s,
                                  "limits": {"memory_mb": 256, "pids": 64, "cpus": 0.25}})
        for s in range(samples):
            kind = "right" if s < samples // 2 else "wrong" if s < samples // 2 + 2 else ADVERSARIAL[
                turn % len(ADVERSARIAL)]
            turn += kind in ADVERSARIAL
            cases.append(Case(task, kind, f"```python\n{PROGRAMS[kind]}```"))
    return cases


Outcome = float | None
"""What the trainer was told: a reward, or None for its own "no reward"."""


async def trl(cases: list[Case], settings: KilnSettings, gateway: str) -> list[Outcome]:
    reward = Verified(settings=settings)  # through the verify stage, as TRL calls it: the whole batch at once
    try:
        return await asyncio.to_thread(reward, [c.completion for c in cases], prompts=[c.task.prompt for c in cases],
                                       kiln_task=[c.label for c in cases])
    finally:
        reward.close()


async def verl(cases: list[Case], settings: KilnSettings, gateway: str) -> list[Outcome]:
    scores = await asyncio.to_thread(compute_score_batch, data_sources=["kiln"] * len(cases),
                                     solution_strs=[c.completion for c in cases], ground_truths=[""] * len(cases),
                                     extra_infos=[{"kiln_task": c.label} for c in cases])
    return [None if s["kiln_failure"] else s["score"] for s in scores]


async def openrlhf(cases: list[Case], settings: KilnSettings, gateway: str) -> list[Outcome]:
    """One request per sample, a group's at once: OpenRLHF's executor (openrlhf 0.11, ``utils/agent.py``)."""
    async with httpx.AsyncClient(timeout=900) as http:
        async def one(case: Case) -> Outcome:
            body = {"query": [case.task.prompt + case.completion], "prompts": [case.task.prompt],
                    "labels": [json.dumps(case.label)]}
            answer = (await http.post(f"{gateway}/openrlhf/reward", json=body)).json()
            return None if answer["extra_logs"]["kiln_failed"][0] else float(answer["rewards"][0])
        return list(await asyncio.gather(*(one(c) for c in cases)))


async def areal(cases: list[Case], settings: KilnSettings, gateway: str) -> list[Outcome]:
    async def one(case: Case) -> Outcome:
        try:
            return await async_reward_fn(case.task.prompt, case.completion, [], [], kiln_task=case.label)
        except NoReward:
            return None
    return list(await asyncio.gather(*(one(c) for c in cases)))


async def prime(cases: list[Case], settings: KilnSettings, gateway: str) -> list[Outcome]:
    import verifiers.v1 as vf

    from kiln.integrations.trainers.prime import KilnTask, KilnTaskData

    async def one(case: Case) -> Outcome:
        trace = vf.Trace.model_construct(root_reply=case.completion, rewards={}, metrics={})
        try:
            await KilnTask(KilnTaskData(prompt=case.task.prompt, kiln_task=case.label)).score(trace)
        except vf.SandboxError:
            return None
        value = trace.rewards["kiln"]
        return float(getattr(value, "value", value))
    return list(await asyncio.gather(*(one(c) for c in cases)))


PATHS: dict[str, Callable[[list[Case], KilnSettings, str], Awaitable[list[Outcome]]]] = {
    "trl": trl, "verl": verl, "openrlhf": openrlhf, "areal": areal, "prime": prime}


def counted(cases: list[Case], outcomes: list[Outcome], adapter: str) -> dict[str, float]:
    right = [o for c, o in zip(cases, outcomes, strict=True) if c.kind == "right"]
    other = [o for c, o in zip(cases, outcomes, strict=True) if c.kind != "right"]
    return {f"reward_fake_zeros_{adapter}": sum(1 for o in right if o == 0.0),
            f"reward_masked_policy_failures_{adapter}": sum(1 for o in other if o is None),
            f"reward_real_verdict_share_{adapter}": round(sum(o is not None for o in outcomes) / len(outcomes), 4),
            f"reward_wrong_scored_1_{adapter}": sum(1 for o in other if o is not None and o > 0)}


class Chaos:
    """The bench's exec workers, one SIGKILLed and replaced every ``kill_every`` s, and their runner containers
    (found by the lock directory their labels name: the bench's own) removed as they appear for ``starve_s`` s from
    ``starve_at`` s."""

    def __init__(self, settings: KilnSettings, env: dict[str, str], lock_dir: Path, count: int, slots: int) -> None:
        self.settings, self.env, self.lock_dir, self.slots = settings, env, lock_dir, slots
        self.workers = [self.spawn() for _ in range(count)]
        self.killed = self.removed = 0
        self.docker = docker_client()

    def spawn(self) -> WorkerProcess:
        return WorkerProcess("exec", self.settings, "exec.requests", slots=self.slots, grace_s=5, env={
            **self.env, "KILN_EXEC_LOCK_DIR": str(self.lock_dir), "KILN_METRICS_PORT": str(free_port())})

    def runners(self) -> list[str]:
        """Ids of the bench's exec workers' containers (the engine's list, without inspecting each: they come and
        go while it is read)."""
        mine = str(self.lock_dir.resolve())
        return [c["Id"] for c in self.docker.api.containers(all=True, filters={"label": "kiln.lock"})
                if (c.get("Labels") or {}).get("kiln.lock", "").startswith(mine)]

    async def run(self, args: argparse.Namespace, done: asyncio.Event) -> None:
        started, rng = time.monotonic(), random.Random(args.seed)
        next_kill = started + args.kill_every
        starve = (started + args.starve_at, started + args.starve_at + args.starve_s)
        while not done.is_set():
            now = time.monotonic()
            if now >= next_kill:
                victim = self.workers.pop(rng.randrange(len(self.workers)))
                await asyncio.to_thread(victim.kill)
                self.killed += 1
                self.workers.append(self.spawn())
                console.print(f"{now - started:5.1f} s: exec worker SIGKILLed and replaced ({self.killed})")
                next_kill += args.kill_every
            if starve[0] <= now < starve[1]:
                for container in await asyncio.to_thread(self.runners):
                    with contextlib.suppress(Exception):  # gone by itself meanwhile
                        await asyncio.to_thread(self.docker.api.remove_container, container, force=True)
                        self.removed += 1
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        WorkerProcess.stop_all(self.workers)


async def run(args: argparse.Namespace) -> dict[str, float]:
    run_steps(COMPONENT_STEPS["docker"])
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    names = ("exec.requests", "verify.requests")
    topics = [TopicSpec("kiln.results", 4), *(TopicSpec(n, 8) for n in names), *(TopicSpec(f"{n}.dlq", 1)
                                                                                  for n in names)]
    admin.create_topics(settings, topics)
    cases = batch(args.prompts, args.samples, args.timeout_s, args.seed)
    adapters = [a for a in args.adapters if a != "prime" or importable("verifiers.v1")]
    notes = {} if "prime" in adapters or "prime" not in args.adapters else {
        "prime": "skipped: verifiers.v1 is not importable (kiln setup trainers)"}
    metrics: dict[str, float] = {}
    trainers.configure(settings)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-bench-fake-zeros-")))
        env = {k: v for k, v in os.environ.items() if k != "KILN_SLOTS"}
        env.update({"KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache)})
        chaos = Chaos(settings, env, tmp / "locks", args.exec_workers, args.exec_slots)
        stack.callback(chaos.stop)
        verify = [stack.enter_context(WorkerProcess("verify", settings, "verify.requests", slots=64, env={
            **env, "KILN_METRICS_PORT": str(free_port())})) for _ in range(args.verify_workers)]
        for worker in [*chaos.workers, *verify]:
            worker.wait_assigned(120)
        gateway = stack.enter_context(gateway_process(settings, tmp / "gateway.log",
                                                      KILN_GATEWAY_OPENRLHF_GROUP_SIZE=str(args.samples)))
        done = asyncio.Event()
        disorder = asyncio.create_task(chaos.run(args, done))
        started = time.monotonic()
        try:
            results = await asyncio.gather(*(PATHS[a](cases, settings, gateway) for a in adapters))
        finally:
            done.set()
            await disorder
            trainers.configure(None)
        metrics["reward_batch_s"] = round(time.monotonic() - started, 1)
        for adapter, outcomes in zip(adapters, results, strict=True):
            metrics.update(counted(cases, outcomes, adapter))
            missed = [f"{c.kind}:{o}" for c, o in zip(cases, outcomes, strict=True)
                      if (o is None) or (o > 0) != (c.kind == "right")]
            if missed:
                notes[adapter] = f"{len(missed)} not as known: " + ", ".join(missed[:8])
        metrics["reward_exec_workers_killed"] = chaos.killed
        metrics["reward_runners_removed"] = chaos.removed
        metrics["reward_batch_completions"] = len(cases)
    admin.delete_topics(settings, [settings.topic(t.name) for t in topics])
    report("fake zeros: a known batch through every trainer adapter, exec workers killed, runners starved", metrics,
           notes)
    return metrics


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (at least 6)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="each program's time limit (wall time: on a "
                        "loaded machine a right program needs several seconds of it)")
    parser.add_argument("--exec-workers", type=int, default=2)
    parser.add_argument("--exec-slots", type=int, default=8, help="sandboxes each exec worker runs at once")
    parser.add_argument("--verify-workers", type=int, default=1)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between exec worker SIGKILLs")
    parser.add_argument("--starve-at", type=float, default=25.0, help="when the runner pool is starved (s)")
    parser.add_argument("--starve-s", type=float, default=5.0, help="for how long")
    parser.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=ADAPTERS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.samples < 6:
        parser.error("--samples: at least 6 (3 right, 2 wrong, an adversarial one)")
    return args


def main() -> None:
    asyncio.run(run(parse()))


if __name__ == "__main__":
    main()
