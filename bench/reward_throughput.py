"""Rewards at the machine's ceiling: the verl-style job (a python a+b over stdin, its output checked against the
expected sum, inputs varied per call) through every kiln path, next to the same commands with no isolation, in one
run (issue 33).

Paths, each at every ``--concurrency`` (closed loop: that many calls in flight):

- ``bare``: ``chroot --userspec=1000:1000 ROOT python3 /tmp/…/main.py`` as asyncio subprocesses — the toolchain
  image's own interpreters, its root filesystem exported once (``docker export``, cached by image id under
  ``$KILN_CACHE/bench-rootfs/``), no isolation at all: the ceiling.
- ``docker_exec``: ``docker exec -i`` of the same program into warm, network-less, read-only containers of the
  image (one per exec-worker slot, calls spread over them round-robin).
- ``gateway``: ``kiln gateway serve`` with the unmodified ``sandbox_fusion`` client (``run_code_async``, one attempt,
  verl's 30 s client timeout) -> exec stage ``run_once``.
- ``gatewaysync``: the same gateway driven as verl drives it: the client's synchronous ``run_code`` (``requests``, a
  new connection per call) in a thread pool of the concurrency's size; ``baresync``: bare's command driven the same
  way (``subprocess.run`` in such a pool), its baseline (``reward_gatewaysync_vs_bare_c<N>`` is ÷ baresync's calls/s;
  ``reward_baresync_vs_bare_c<N>`` is what the pool itself costs the baseline).
- ``execcheck``: the rollout stage's ``ExecVerifier`` (``ExecCheck``, ``isolate``: the checker runs sample code)
  verifying groups of ``--group`` completions (each group one prompt: its stdin; the checker runs every completion's
  program on it and prints the verdicts); concurrency = completions in flight; a completion's latency is its group's.
- ``trl``: ``kiln.integrations.trainers.trl.OutputMatches`` scoring batches of ``concurrency`` completions (TRL calls
  a reward function synchronously with a batch); a completion's latency is its batch's.

Cases at ``--case-concurrency`` (64): ``cpp`` — a C++ a+b compiled and run (``gateway`` with language ``cpp`` vs
bare ``g++ -O2 -std=c++17`` + run in the chroot); ``pytest`` — a small package and its test file run with
``python3 -m pytest -q`` (``runonce``: ``ExecClient.run_once`` vs bare in the chroot).

METRIC lines: ``reward_<path>_calls_per_s_c<N>``, ``_p50_s_c<N>``, ``_p99_s_c<N>``, ``_errors_c<N>`` (a wrong
answer or a failed call), ``reward_<path>_vs_bare_c<N>`` (calls/s ÷ bare's in the same run), the same for
``reward_cpp_{bare,gateway}_*`` and ``reward_pytest_{bare,runonce}_*``; ``reward_exec_worker_slots`` (what the exec
worker chose: it is started without ``--slots``), ``reward_loadavg_1m_{start,end}`` and
``reward_idle_cpu_ms_per_s_{broker,docker,machine}`` (what they spend with no call in flight, over 5 s before the
phases: the machine's other work, in every per-call figure as that rate ÷ the phase's calls/s).
Every path is warmed before it is measured; phases alternate (every path once per round, ``--rounds``) so drift hits
all paths alike. Aims (issue 33, reported, not asserted): every kiln path ≥ 0.7 of bare; p99 ≤ 3x p50; 0 errors.

Diagnostics: ``reward_<path>_worker_s_per_run_once_c<N>`` (the exec worker's own handling time of one run_once, from
its metrics) and ``reward_<path>_cpu_ms_<part>_c<N>`` (CPU milliseconds per call by process: client — this process,
the trainer's side —, children, worker, gateway, sandbox — the CPU cgroups of the runners and of the docker_exec
containers —, broker, docker — dockerd and containerd —, shims — the containerd shims of those containers, which carry
every attached ``docker exec`` stream —; the broker and Docker's daemons are shared with whatever else runs on the
host). Derived, per call: ``_cpu_ms_kiln_c<N>`` (every process but the sandbox's: the parts above but sandbox, for
kiln's paths), ``_cpu_ms_sandbox_over_bare_c<N>`` (the sandbox's CPU minus bare's children: bare's chroot and python
are its sandbox; gatewaysync against baresync), ``_cpu_ms_total_c<N>`` (the whole machine's busy CPU from
/proc/stat, other load included) and ``_cpu_ms_total_over_bare_c<N>`` (that minus its bare's). Experiments, never the
headline: ``--exec-slots N`` (the worker told its slots), ``--bare-cgroup`` (bare's processes in a CPU cgroup beside
the containers').

Usage: python -m bench.reward_throughput [--calls 256] [--concurrency 64 256] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import os
import resource
import shutil
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.common import broker, console, percentile, report
from kiln.integrations.trainers.trl import OutputMatches
from kiln.schemas.rl import RolloutTask
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.stage import TopicSpec
from kiln.workers.common.containers import docker_client
from kiln.workers.exec.client import ExecClient
from kiln.workers.exec.stage import stage as exec_stage
from kiln.workers.rollout.stage import RolloutSettings
from kiln.workers.verifiers import ExecVerifier, VerifierContext
from tests.integrations.gateway.conftest import gateway_process

IMAGE = "kiln/toolchain:latest"
PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
CPP = ("#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; "
       "return 0; }\n")
CPP_COMPILE = "g++ -O2 -std=c++17 -o main main.cpp"  # the gateway's own (integrations/gateway/languages.py)
PYTEST = "python3 -m pytest -q -p no:cacheprovider"
# The checker of the execcheck path: every completion's program on the group's stdin (its prompt), verdict 1 when it
# prints the group's answer. Programs of a group run side by side (each in its own directory).
CHECKER = r'''import json, os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

def verdict(group, i, program):
    d = f"g{group['task_id']}-{i}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/main.py", "w") as f:
        f.write(program)
    try:
        done = subprocess.run([sys.executable, "main.py"], cwd=d, input=group["prompt"], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return {"reward": 0.0, "why": "timeout"}
    ok = done.returncode == 0 and done.stdout.strip() == group["answer"].strip()
    return {"reward": 1.0 if ok else 0.0, "exit": done.returncode}

with open("groups.jsonl") as f:
    groups = [json.loads(line) for line in f if line.strip()]
for group in groups:
    with ThreadPoolExecutor(max(1, len(group["completions"]))) as pool:
        verdicts = list(pool.map(lambda c: verdict(group, *c), enumerate(group["completions"])))
    print(json.dumps({"verdicts": verdicts}), flush=True)
'''
# The sandbox's environment (workers/exec/runners.py) on top of the image's.
SANDBOX_ENV = {"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
CPU_CGROUP = Path("/sys/fs/cgroup/cpu/docker")  # Docker's containers' parent CPU cgroup (cgroup v1, cgroupfs)


def job(n: int) -> tuple[str, str]:
    """Call ``n``'s stdin and expected output: inputs differ per call (no cache could answer)."""
    a, b = (n * 7919 + 13) % 1_000_003 - 500_000, (n * 104_729 + 7) % 999_983
    return f"{a} {b}\n", str(a + b)


def pytest_files(n: int) -> dict[str, str]:
    """A small package and its tests; the expected values vary per call."""
    stdin, expected = job(n)
    a, b = stdin.split()
    return {"calc/__init__.py": "from calc.ops import add, mul\n",
            "calc/ops.py": "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
            "tests/test_calc.py": ("import pytest\nfrom calc import add, mul\n\n\n"
                                   f"def test_add():\n    assert add({a}, {b}) == {expected}\n\n\n"
                                   f"@pytest.mark.parametrize('x', range(4))\ndef test_mul(x):\n"
                                   f"    assert mul({a}, x) == {a} * x\n")}


PYTEST_PASSED = "5 passed"


# --- measurement ------------------------------------------------------------------------------------------------


@dataclass
class Phase:
    """What one path did at one concurrency, over every round."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    first_errors: list[str] = field(default_factory=list)
    spent: dict[str, float] = field(default_factory=dict)  # Accounts deltas over the measured rounds

    def fail(self, why: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 3:
            self.first_errors.append(why[:300])

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


# One path: run calls [start, start + count) at ``concurrency``, recording into the phase and advancing the bar.
PathRun = Callable[[int, int, int, Phase, Callable[[int], None]], Awaitable[None]]
Call = Callable[[int], Awaitable[str | None]]  # None = right answer, else what went wrong
SyncCall = Callable[[int], str | None]  # the same, blocking (run in a pool thread)


def per_call(one: Call) -> PathRun:
    """A closed loop: ``concurrency`` calls in flight, each timed from its start to its answer."""
    async def run(start: int, count: int, concurrency: int, phase: Phase, advance: Callable[[int], None]) -> None:
        gate = asyncio.Semaphore(concurrency)

        async def call(n: int) -> None:
            async with gate:
                t = time.perf_counter()
                try:
                    wrong = await one(n)
                except Exception as e:
                    wrong = f"{type(e).__name__}: {e}"
                phase.latencies.append(time.perf_counter() - t)
                if wrong is not None:
                    phase.fail(wrong)
                advance(1)
        await asyncio.gather(*(call(n) for n in range(start, start + count)))
    return run


def pooled(one: SyncCall) -> PathRun:
    """verl's pattern: a thread pool of ``concurrency`` threads, each call a blocking one, the pool drained by one
    driving thread (``as_completed``); each call timed in its thread from its start to its answer."""
    def drive(start: int, count: int, concurrency: int, phase: Phase, advance: Callable[[int], None]) -> None:
        def call(n: int) -> tuple[float, str | None]:
            t = time.perf_counter()
            try:
                wrong = one(n)
            except Exception as e:
                wrong = f"{type(e).__name__}: {e}"
            return time.perf_counter() - t, wrong

        with ThreadPoolExecutor(concurrency) as pool:
            for done in as_completed([pool.submit(call, n) for n in range(start, start + count)]):
                seconds, wrong = done.result()
                phase.latencies.append(seconds)
                if wrong is not None:
                    phase.fail(wrong)
                advance(1)

    async def run(start: int, count: int, concurrency: int, phase: Phase, advance: Callable[[int], None]) -> None:
        await asyncio.to_thread(drive, start, count, concurrency, phase, advance)
    return run


async def measure(runs: dict[str, PathRun], calls: int, concurrency: int, rounds: int, warm: int,
                  progress: Progress, offset: int, accounts: Accounts | None = None) -> dict[str, Phase]:
    """Warm every path, then ``rounds`` rounds of every path in turn."""
    phases = {name: Phase() for name in runs}
    for name, run in runs.items():
        task = progress.add_task(f"warm {name}", total=warm)
        await run(offset, warm, min(concurrency, warm), Phase(), functools.partial(progress.advance, task))
        progress.remove_task(task)
    per_round = math.ceil(calls / rounds)
    for r in range(rounds):
        for name, run in (runs.items() if r % 2 == 0 else reversed(runs.items())):
            task = progress.add_task(f"c{concurrency} {name} round {r + 1}/{rounds}", total=per_round)
            if accounts:
                await asyncio.to_thread(accounts.drain)
            before = await asyncio.to_thread(accounts.snapshot) if accounts else {}
            started = time.perf_counter()
            await run(offset + 100_000 * (r + 1), per_round, concurrency, phases[name],
                      functools.partial(progress.advance, task))
            phases[name].seconds += time.perf_counter() - started
            after = await asyncio.to_thread(accounts.snapshot) if accounts else {}
            for key, value in after.items():
                phases[name].spent[key] = phases[name].spent.get(key, 0.0) + value - before[key]
            progress.remove_task(task)
            console.print(f"  {time.strftime('%H:%M:%S')} c{concurrency} {name} round {r + 1}: "
                          f"{phases[name].rate:.1f} calls/s so far, {phases[name].errors} errors, load {loadavg()}")
    return phases


def metrics_of(prefix: str, phases: dict[str, Phase], concurrency: int, baselines: dict[str, str]) -> dict[str, float]:
    """Every phase's figures; ``baselines``: each compared path's own bare path (ratios and CPU over it)."""
    out: dict[str, float] = {}
    per_call_ms: dict[str, dict[str, float]] = {}
    for name, phase in phases.items():
        out[f"{prefix}{name}_calls_per_s_c{concurrency}"] = round(phase.rate, 2)
        out[f"{prefix}{name}_p50_s_c{concurrency}"] = round(percentile(phase.latencies, 0.5), 3)
        out[f"{prefix}{name}_p99_s_c{concurrency}"] = round(percentile(phase.latencies, 0.99), 3)
        out[f"{prefix}{name}_errors_c{concurrency}"] = phase.errors
        spent, calls = phase.spent, len(phase.latencies)
        if spent.get("run_once"):  # the exec worker's own time for one run_once request (handler, slot held)
            out[f"{prefix}{name}_worker_s_per_run_once_c{concurrency}"] = round(spent["worker_s"] / spent["run_once"],
                                                                                 3)
        if spent and calls:  # CPU milliseconds per call, by where they were spent
            ms = {part: spent[key] * 1000 / calls for part, key in CPU_PARTS.items()}
            for part, value in ms.items():
                out[f"{prefix}{name}_cpu_ms_{part}_c{concurrency}"] = round(value, 1)
            sandbox = "children" if name in BARE_PATHS else "sandbox"
            per_call_ms[name] = {"sandbox": ms[sandbox], "total": spent["machine"] * 1000 / calls}
            if name not in BARE_PATHS:  # every process but the sandbox's
                out[f"{prefix}{name}_cpu_ms_kiln_c{concurrency}"] = round(sum(ms.values()) - ms[sandbox], 1)
            out[f"{prefix}{name}_cpu_ms_total_c{concurrency}"] = round(per_call_ms[name]["total"], 1)
    for name, base in baselines.items():
        rate = phases[base].rate
        out[f"{prefix}{name}_vs_bare_c{concurrency}"] = round(phases[name].rate / rate, 3) if rate else 0.0
        if name in per_call_ms and base in per_call_ms:
            for what in ("sandbox", "total"):
                over = per_call_ms[name][what] - per_call_ms[base][what]
                out[f"{prefix}{name}_cpu_ms_{what}_over_bare_c{concurrency}"] = round(over, 1)
    return out


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pids(match: Callable[[list[str]], bool]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if argv and match(argv):
                found.append(int(entry.name))
    return found


def docker_daemons() -> list[int]:
    """This machine's Docker daemon (``dockerd`` in this process's mount namespace: not one running inside a
    container or a pod, Docker in Docker) and the ``containerd`` it started."""
    mine = os.readlink("/proc/self/ns/mnt")

    def ours(pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/mnt") == mine
        except OSError:
            return False
    daemons = [pid for pid in _pids(lambda a: Path(a[0]).name == "dockerd") if ours(pid)]
    return [*daemons, *(pid for pid in _pids(lambda a: Path(a[0]).name == "containerd") if _parent(pid) in daemons)]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


class Accounts:
    """Where the CPU goes, read before and after every phase: this process (the clients: KilnClient, the
    SandboxFusion client, TRL's reward thread), its children (bare's chroot + python, docker CLIs), the exec worker,
    the gateway, the sandboxes (cgroups of the worker's runners and of the docker_exec containers), the broker and
    Docker's daemons (both shared with whatever else runs on the machine: upper bounds), the containerd shims of the
    sandboxes' containers, and the whole machine's busy CPU (/proc/stat). Also the exec worker's own account of its
    ``run_once`` requests (its metrics: seconds and count)."""

    def __init__(self, client: Any, metrics_port: int, worker_pid: int, gateway_port: str | None, lock_dir: Path,
                 containers: list[Any], broker_port: str) -> None:
        self.client, self.metrics_port, self.worker_pid, self.lock_dir = client, metrics_port, worker_pid, lock_dir
        self.containers = [c.id for c in containers]
        self.gateway = _pids(lambda a: "gateway" in a and gateway_port in a) if gateway_port else []
        self.broker = _pids(lambda a: a[0].endswith("java") and any(f"kafka-{broker_port}" in x for x in a))
        self.docker = docker_daemons()
        self.worker_id = ""

    def _runners(self) -> list[str]:
        if not self.worker_id:
            self.worker_id = next((p.stem for p in self.lock_dir.glob("*.lock")), "")
        if not self.worker_id:
            return []
        return [c.id for c in self.client.containers.list(filters={"label": f"kiln.worker={self.worker_id}"})]

    def _metrics(self) -> dict[str, float]:
        """The exec worker's run_once seconds and count so far, its busy slots and queued jobs now."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        found: dict[str, float] = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in ("kiln_exec_command_seconds_sum", "kiln_exec_command_seconds_count"):
                if 'op="run_once"' in line:
                    found[name] = float(line.rsplit(" ", 1)[1])
            elif name in ("kiln_busy_slots", "kiln_queue_length"):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return found

    def drain(self, timeout_s: float = 180.0) -> None:
        """Until the exec worker has nothing running or queued: requests a client gave up on (a timeout) still run,
        and must not weigh on the next path's phase."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self._metrics()
            if not now or now.get("kiln_busy_slots", 0) + now.get("kiln_queue_length", 0) == 0:
                return
            time.sleep(0.5)

    def snapshot(self) -> dict[str, float]:
        me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        containers = {*self.containers, *self._runners()}
        sandboxes = 0.0
        for cid in containers:
            with contextlib.suppress(OSError, ValueError):
                sandboxes += int(Path(f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage").read_text()) / 1e9
        # A container's shim relays its attached exec streams (containerd-shim-runc-v2 ... -id CONTAINER ...).
        shims = _pids(lambda a: Path(a[0]).name.startswith("containerd-shim") and bool(containers & {*a}))
        metrics = self._metrics()
        worker_s, run_once = (metrics.get(f"kiln_exec_command_seconds_{w}", 0.0) for w in ("sum", "count"))
        return {"client": me.ru_utime + me.ru_stime, "children": children.ru_utime + children.ru_stime,
                "worker": proc_cpu(self.worker_pid), "gateway": sum(map(proc_cpu, self.gateway)),
                "sandboxes": sandboxes, "broker": sum(map(proc_cpu, self.broker)),
                "docker": sum(map(proc_cpu, self.docker)), "shims": sum(map(proc_cpu, shims)),
                "machine": machine_cpu(), "worker_s": worker_s, "run_once": run_once}


def machine_cpu() -> float:
    """The machine's busy CPU seconds so far, every core (/proc/stat: user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# Parts of a call's CPU, by process, as printed (``sandbox``: the snapshot's ``sandboxes``, the containers' cgroups).
CPU_PARTS = {"client": "client", "children": "children", "worker": "worker", "gateway": "gateway",
             "sandbox": "sandboxes", "broker": "broker", "docker": "docker", "shims": "shims"}
IDLE_S = 5.0  # the idle window measured before the phases
BARE_PATHS = ("bare", "baresync")  # their children (chroot and the program) are their sandbox


# --- bare: the image's root filesystem, chrooted ----------------------------------------------------------------


def image_env(client: Any, image: str) -> dict[str, str]:
    env = dict(e.split("=", 1) for e in client.images.get(image).attrs["Config"].get("Env") or [])
    return {**env, **SANDBOX_ENV}


def exported_root(client: Any, image: str, cache: Path) -> Path:
    """The image's root filesystem, exported once per image id (``docker export`` of a created container)."""
    image_id: str = client.images.get(image).id.split(":")[-1][:16]
    root = cache / "bench-rootfs" / image_id
    if root.is_dir():
        return root
    partial = root.with_name(f"{image_id}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir(parents=True)
    container = client.containers.create(image, ["true"], network_disabled=True)
    console.print(f"exporting {image}'s root filesystem to {root} (once per image id)")
    try:
        export = subprocess.Popen(["docker", "export", container.id], stdout=subprocess.PIPE)
        untar = subprocess.run(["tar", "-x", "-C", str(partial)], stdin=export.stdout, capture_output=True, check=False)
        if export.wait() != 0 or untar.returncode != 0:
            raise RuntimeError(f"exporting {image} failed: {untar.stderr.decode()[-1000:]}")
        partial.replace(root)
    finally:
        container.remove(force=True)
        shutil.rmtree(partial, ignore_errors=True)
    return root


class Bare:
    """Per-call directories under ``ROOT/tmp/kiln-bench-*`` (removed after each call and at the end), the command
    run by ``chroot --userspec=1000:1000``: the image's interpreters and compilers, no isolation."""

    def __init__(self, root: Path, env: dict[str, str], cgroup: bool = False) -> None:
        self.root, self.env = root, env
        self.scratch = Path(tempfile.mkdtemp(prefix="kiln-bench-", dir=root / "tmp"))
        self.scratch.chmod(0o777)
        # --bare-cgroup: bare's processes in a CPU cgroup beside the containers' (cgroup v1: under /docker), so that
        # on a host others load, bare and the sandboxes get the same CPU share; by default they run in this
        # process's cgroup, where each competes with every other task on the host on its own.
        self.cgroup: Path | None = None
        if cgroup:
            self.cgroup = CPU_CGROUP / f"kiln-bench-bare-{uuid.uuid4().hex[:8]}"
            self.cgroup.mkdir()

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()

    @contextlib.contextmanager
    def call_dir(self, n: int, files: dict[str, str]) -> Iterator[str]:
        host = self.scratch / f"c{n}-{uuid.uuid4().hex[:6]}"
        for path, text in files.items():
            (host / path).parent.mkdir(parents=True, exist_ok=True)
            (host / path).write_text(text)
        for p in [host, *host.rglob("*")]:
            p.chmod(0o777 if p.is_dir() else 0o666)
        try:
            yield "/" + str(host.relative_to(self.root))
        finally:
            shutil.rmtree(host, ignore_errors=True)

    def chrooted(self, argv: list[str]) -> list[str]:
        enter = ["sh", "-c", f'echo $$ > {self.cgroup}/tasks && exec "$0" "$@"'] if self.cgroup else []
        return [*enter, CHROOT, "--userspec=1000:1000", str(self.root), *argv]

    async def run(self, argv: list[str], stdin: str = "") -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *self.chrooted(argv), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self.env)
        out, err = await proc.communicate(stdin.encode())
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    async def python(self, n: int) -> str | None:
        stdin, expected = job(n)
        with self.call_dir(n, {"main.py": PROGRAM}) as d:
            code, out, err = await self.run(["python3", f"{d}/main.py"], stdin)
        return None if code == 0 and out.strip() == expected else f"exit {code}: {out[-200:]!r} {err[-300:]!r}"

    def python_sync(self, n: int) -> str | None:
        """The same call from a pool thread: ``subprocess.run``, as a synchronous reward function runs it (no time
        limit, as ``python``)."""
        stdin, expected = job(n)
        with self.call_dir(n, {"main.py": PROGRAM}) as d:
            done = subprocess.run(self.chrooted(["python3", f"{d}/main.py"]), input=stdin.encode(),
                                  capture_output=True, env=self.env, check=False)
        out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        ok = done.returncode == 0 and out.strip() == expected
        return None if ok else f"exit {done.returncode}: {out[-200:]!r} {err[-300:]!r}"

    async def cpp(self, n: int) -> str | None:
        stdin, expected = job(n)
        with self.call_dir(n, {"main.cpp": CPP}) as d:
            code, out, err = await self.run(["sh", "-c", f"cd {d} && {CPP_COMPILE} && exec ./main"], stdin)
        return None if code == 0 and out.strip() == expected else f"exit {code}: {out[-200:]!r} {err[-300:]!r}"

    async def pytest(self, n: int) -> str | None:
        with self.call_dir(n, pytest_files(n)) as d:
            code, out, err = await self.run(["sh", "-c", f"cd {d} && exec {PYTEST}"])
        return None if code == 0 and PYTEST_PASSED in out else f"exit {code}: {out[-300:]!r} {err[-300:]!r}"


# --- docker exec into warm containers ---------------------------------------------------------------------------


class DockerExec:
    """``count`` warm containers of the image (no network, read-only root, tmpfs /tmp, uid 1000, the sandbox's CPU,
    memory and pids limits), ``docker exec -i`` of the program, calls spread round-robin."""

    def __init__(self, client: Any, image: str, count: int, tag: str) -> None:
        self.client, self.image, self.count, self.tag = client, image, count, tag
        self.containers: list[Any] = []

    def start(self) -> None:
        client, image, tag = self.client, self.image, self.tag
        for _ in range(self.count):
            self.containers.append(client.containers.run(
                image, ["sleep", "infinity"], detach=True, name=f"kiln-bench-reward-{tag}-{len(self.containers)}",
                network_mode="none", read_only=True, user="1000:1000", working_dir="/tmp",
                tmpfs={"/tmp": "size=256m,uid=1000,gid=1000,mode=1777,exec"}, mem_limit=1 << 30,
                nano_cpus=10**9, pids_limit=256, security_opt=["no-new-privileges"], cap_drop=["ALL"], init=True,
                environment=SANDBOX_ENV, labels={"kiln-bench": "reward_throughput"}))

    def close(self) -> None:
        for container in self.containers:
            with contextlib.suppress(Exception):
                container.remove(force=True)

    async def python(self, n: int) -> str | None:
        stdin, expected = job(n)
        name = self.containers[n % len(self.containers)].name
        proc = await asyncio.create_subprocess_exec(
            "docker", "exec", "-i", name, "python3", "-c", PROGRAM, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate(stdin.encode())
        ok = proc.returncode == 0 and out.decode().strip() == expected
        return None if ok else f"exit {proc.returncode}: {out[-200:]!r} {err[-300:]!r}"


# --- kiln's paths -----------------------------------------------------------------------------------------------


def gateway_request(n: int, language: str) -> tuple[Any, str]:
    """Call ``n``'s SandboxFusion request and expected output."""
    import sandbox_fusion  # type: ignore[import-untyped]  # the peer's client, unmodified

    stdin, expected = job(n)
    return sandbox_fusion.RunCodeRequest(code=PROGRAM if language == "python" else CPP, language=language, stdin=stdin,
                                         compile_timeout=60, run_timeout=10), expected


def gateway_wrong(response: Any, expected: str) -> str | None:
    import sandbox_fusion

    run = response.run_result
    if response.status != sandbox_fusion.RunStatus.Success or run is None or (run.stdout or "").strip() != expected:
        return f"{response.status}: {response.message} {run}"[:400]
    return None


def gateway_call(url: str, language: str = "python") -> Call:
    import sandbox_fusion

    async def one(n: int) -> str | None:
        request, expected = gateway_request(n, language)
        # One attempt (a retry would hide a failure) and verl's client timeout.
        response = await sandbox_fusion.run_code_async(request, endpoint=url, max_attempts=1, client_timeout=30)
        return gateway_wrong(response, expected)
    return one


def gateway_sync_call(url: str) -> SyncCall:
    """verl's call: the client's synchronous ``run_code`` (``requests``), one attempt, verl's client timeout."""
    import sandbox_fusion

    def one(n: int) -> str | None:
        request, expected = gateway_request(n, "python")
        return gateway_wrong(sandbox_fusion.run_code(request, endpoint=url, max_attempts=1, client_timeout=30),
                             expected)
    return one


def execcheck_run(verifier: ExecVerifier, group: int) -> PathRun:
    """Groups of ``group`` completions (one prompt each), ``concurrency // group`` groups in flight."""
    check = {"image": IMAGE, "command": "python3 check.py", "files": {"check.py": CHECKER}, "isolate": True,
             "timeout_s": 60}
    completions = [PROGRAM] * group

    async def run(start: int, count: int, concurrency: int, phase: Phase, advance: Callable[[int], None]) -> None:
        gate = asyncio.Semaphore(max(1, concurrency // group))

        async def one(g: int) -> None:
            stdin, expected = job(g)
            task = RolloutTask(task_id=str(g), prompt=stdin, answer=expected, verifier="exec", check=check)
            async with gate:
                t = time.perf_counter()
                try:
                    verdicts = await verifier.verify(task, completions, f"bench-{g}")
                    wrong = [f"verdict {v.reward} {v.details}" for v in verdicts if v.reward != 1.0]
                except Exception as e:
                    wrong = [f"{type(e).__name__}: {e}"] * group
                seconds = time.perf_counter() - t
            phase.latencies += [seconds] * group
            for why in wrong:
                phase.fail(why)
            advance(group)
        await asyncio.gather(*(one(start + i) for i in range(max(1, count // group))))
    return run


def trl_run(reward: OutputMatches) -> PathRun:
    """Batches of ``concurrency`` completions, one after the other, as TRL scores them."""
    completion = f"```python\n{PROGRAM}```"

    async def run(start: int, count: int, concurrency: int, phase: Phase, advance: Callable[[int], None]) -> None:
        for first in range(start, start + count, concurrency):
            ns = range(first, min(first + concurrency, start + count))
            jobs = [job(n) for n in ns]
            t = time.perf_counter()
            try:
                rewards = await asyncio.to_thread(reward, [completion] * len(jobs), stdin=[s for s, _ in jobs],
                                                  expected_output=[e for _, e in jobs])
                wrong = [f"reward {r} (a failed call scores 0)" for r in rewards if r != 1.0]
            except Exception as e:
                wrong = [f"{type(e).__name__}: {e}"] * len(jobs)
            phase.latencies += [time.perf_counter() - t] * len(jobs)
            for why in wrong:
                phase.fail(why)
            advance(len(jobs))
    return run


def runonce_pytest(exec_client: ExecClient) -> Call:
    async def one(n: int) -> str | None:
        result = await exec_client.run_once(IMAGE, PYTEST, files={f"case/{p}": t for p, t in pytest_files(n).items()},
                                            cwd="case", timeout_s=60)
        out = result.output
        if out is None or out.exit_code != 0 or PYTEST_PASSED not in out.stdout:
            return f"{out}"[:400]
        return None
    return one


# --- the run ----------------------------------------------------------------------------------------------------


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


async def run(args: argparse.Namespace) -> dict[str, float]:
    run_steps(COMPONENT_STEPS["docker"])
    settings = broker().model_copy(update={"topic_prefix": f"bench-{uuid.uuid4().hex[:8]}."})
    topics = [TopicSpec("exec.requests", 8), TopicSpec("exec.requests.dlq", 1), TopicSpec("kiln.results", 4)]
    admin.create_topics(settings, topics)
    client = docker_client()
    metrics: dict[str, float] = {"reward_loadavg_1m_start": loadavg()}
    # What the exec worker picks when it is not told its slots (it runs on this machine, with this environment).
    slots = args.exec_slots or settings.model_copy(update={"slots": 0}).job_slots(exec_stage.slots_per_cpu)
    metrics["reward_exec_worker_slots"] = slots
    cleanup = contextlib.AsyncExitStack()
    notes: dict[str, str] = {}
    try:
        tmp = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kiln-bench-reward-")))
        root = await asyncio.to_thread(exported_root, client, IMAGE, settings.cache)
        bare = Bare(root, image_env(client, IMAGE), args.bare_cgroup)
        cleanup.callback(bare.close)
        docker_exec = DockerExec(client, IMAGE, slots, uuid.uuid4().hex[:6])
        cleanup.callback(docker_exec.close)
        await asyncio.to_thread(docker_exec.start)
        # The worker is not told its slots (KILN_SLOTS included): kiln picks them.
        if (saved := os.environ.pop("KILN_SLOTS", None)) is not None:
            cleanup.callback(os.environ.__setitem__, "KILN_SLOTS", saved)
        metrics_port = free_port()
        # slots=0: no --slots of its own, kiln picks (--exec-slots only for an experiment, reported as such).
        worker = WorkerProcess("exec", settings, "exec.requests", slots=args.exec_slots, env={
            "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache),
            "KILN_EXEC_LOCK_DIR": str(tmp / "locks"), "KILN_METRICS_PORT": str(metrics_port)})
        cleanup.callback(worker.stop)
        worker.wait_assigned(120)
        url = cleanup.enter_context(gateway_process(settings, tmp / "gateway.log"))
        kiln = await cleanup.enter_async_context(KilnClient(settings, f"bench-reward-{uuid.uuid4().hex[:6]}"))
        rollout = RolloutSettings()
        verifier = ExecVerifier(VerifierContext(kiln, exec_calls=rollout.exec_calls,
                                                exec_batch_groups=rollout.exec_batch_groups,
                                                exec_batch_window_s=rollout.exec_batch_window_s,
                                                exec_batch_quiet_s=rollout.exec_batch_quiet_s))
        reward = OutputMatches(settings=settings)
        cleanup.callback(reward.close)
        exec_client = ExecClient(kiln)
        accounts = Accounts(client, metrics_port, worker.proc.pid, url.rsplit(":", 1)[1], tmp / "locks",
                            docker_exec.containers, settings.bootstrap_servers.rsplit(":", 1)[1])
        runs: dict[str, PathRun] = {"bare": per_call(bare.python), "baresync": pooled(bare.python_sync),
                                    "docker_exec": per_call(docker_exec.python),
                                    "gateway": per_call(gateway_call(url)),
                                    "gatewaysync": pooled(gateway_sync_call(url)),
                                    "execcheck": execcheck_run(verifier, args.group), "trl": trl_run(reward)}
        baselines = {"baresync": "bare", "docker_exec": "bare", "gateway": "bare", "gatewaysync": "baresync",
                     "execcheck": "bare", "trl": "bare"}
        # What the shared parts spend with no call in flight: over a phase, that rate ÷ its calls/s is in its
        # per-call figures (the machine's other work).
        before = await asyncio.to_thread(accounts.snapshot)
        await asyncio.sleep(IDLE_S)
        after = await asyncio.to_thread(accounts.snapshot)
        for part in ("broker", "docker", "machine"):
            metrics[f"reward_idle_cpu_ms_per_s_{part}"] = round((after[part] - before[part]) * 1000 / IDLE_S, 1)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            for i, c in enumerate(args.concurrency):
                calls = max(args.calls, c * args.rounds) if not args.quick else args.calls
                phases = await measure(runs, calls, c, args.rounds, args.warm, progress, 1_000_000 * (i + 1),
                                       accounts)
                metrics.update(metrics_of("reward_", phases, c, baselines))
                notes.update({f"first errors {name} c{c}": " | ".join(p.first_errors)
                              for name, p in phases.items() if p.first_errors})
            c = args.case_concurrency
            cases: list[tuple[str, dict[str, PathRun], str]] = [
                ("cpp", {"bare": per_call(bare.cpp), "gateway": per_call(gateway_call(url, "cpp"))}, "gateway"),
                ("pytest", {"bare": per_call(bare.pytest), "runonce": per_call(runonce_pytest(exec_client))},
                 "runonce")]
            for j, (case, case_runs, kiln_path) in enumerate([] if args.no_cases else cases):
                calls = max(args.case_calls, c) if not args.quick else args.case_calls
                phases = await measure(case_runs, calls, c, max(1, min(args.rounds, calls // c)), args.warm,
                                       progress, 10_000_000 * (j + 1), accounts)
                metrics.update(metrics_of(f"reward_{case}_", phases, c, {kiln_path: "bare"}))
                notes.update({f"first errors {case} {name}": " | ".join(p.first_errors)
                              for name, p in phases.items() if p.first_errors})
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            await cleanup.aclose()
        admin.delete_topics(settings, [settings.topic(t.name) for t in topics])
    metrics["reward_loadavg_1m_end"] = loadavg()
    report("reward throughput: kiln's reward paths vs bare processes (same run)", metrics, notes)
    return metrics


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=256, help="calls per path per concurrency (at least "
                                                              "concurrency x rounds)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every path")
    parser.add_argument("--warm", type=int, default=16, help="calls per path before measuring")
    parser.add_argument("--group", type=int, default=8, help="completions per execcheck group")
    parser.add_argument("--case-calls", type=int, default=64, help="calls per path of the cpp and pytest cases")
    parser.add_argument("--case-concurrency", type=int, default=64)
    parser.add_argument("--exec-slots", type=int, default=0, help="an experiment only: the exec worker's slots "
                        "(default: not told, kiln picks; the docker_exec containers follow)")
    parser.add_argument("--bare-cgroup", action="store_true", help="bare's processes in a CPU cgroup beside the "
                        "containers' (a fair baseline on a host others load; cgroup v1)")
    parser.add_argument("--no-cases", action="store_true", help="skip the cpp and pytest cases")
    parser.add_argument("--quick", action="store_true", help="smoke test: 8 calls at concurrency 4, groups of 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.concurrency, args.rounds, args.warm = 8, [4], 2, 4
        args.group, args.case_calls, args.case_concurrency = 2, 4, 4
    return args


async def main() -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # sandbox_fusion's pydantic v1 calls
    await run(parse())


if __name__ == "__main__":
    asyncio.run(main())
