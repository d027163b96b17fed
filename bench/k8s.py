"""kiln on a real Kubernetes node (issue 48): the one-node cluster of ``infra/k8s/cluster.sh`` (k8s v1.32 from its Go
modules, containerd, KEDA), kiln's Kafka, S3 and registry on the pods' bridge, and ``kiln k8s render | kubectl
apply`` with values that shrink the pods' requests to fit 2 CPUs. Then, each phase timed and reported:

- ``jobs``: a job of each stage answered from the pods (echo, Lean on the fake REPL, verify, exec).
- ``replay``: a sleep worker's pod force-deleted mid-job (preemption): its job replays on the other pod, and 20
  jobs submitted around the deletion are all answered (``k8s_replay_s``, ``k8s_lost_jobs``).
- ``limits``: an exec sandbox started by an exec pod's engine sidecar, with a memory bomb, a (bounded) fork bomb and
  a CPU spinner against its --memory, --pids-limit and --cpus (``k8s_sandbox_*``: 1 enforced, 0 not).
- ``chain``: a repository served by ``git daemon`` on the bridge ingested (Saucer), built into an image (build pod,
  its engine sidecar, pushed to the registry), its tests run in an exec session on that image, and patches scored
  through the verify stage (the demo's calc repository and candidate patches). The build pod is replaced after the
  build and the exec pod after the chain: their engines' emptyDirs hold GBs of this shared disk.
- ``spare``: the spare-CPU DaemonSet's Lean worker: its slots are the node's CPUs times its ``KILN_CPU_FRACTION``
  (its heartbeat, ``k8s_spare_slots`` against ``k8s_spare_expected_slots``), and it answers a share of a burst of
  Lean jobs beside the Lean Deployment (``k8s_spare_lean_jobs`` of ``k8s_spare_burst``).
- ``scale``: a queue on the exec stage; KEDA (through the autoscaler's /keda/exec) raises its Ready replicas from 1
  to ``--scale-to`` and, once the queue drained, brings them back (``k8s_scale_up_s``, ``k8s_scale_down_s``); the
  rescales of the HPA KEDA made are counted from its events (``k8s_hpa_rescales``).

    python -m bench.k8s [--phases up,apply,jobs,replay,limits,chain,spare,scale] [--down]

Ports: Kafka 59092 (pods reach its NODES listener at <bridge>:59095), S3 59570, registry 59500, git daemon 59600 (on
the bridge).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import yaml

from bench.common import console, report, until
from kiln.integrations.demo.story import CANDIDATES, NAME, DemoSettings, Story
from kiln.schemas.builder import BuildRequest
from kiln.schemas.builtin import EchoRequest, SleepRequest
from kiln.schemas.exec import SessionLimits
from kiln.schemas.ingest import IngestRequest
from kiln.schemas.lean import LeanRequest
from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.k8s.render import STATS_PORT
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import stage_specs
from kiln.workers.builder.client import BuilderClient
from kiln.workers.exec.client import ExecClient
from kiln.workers.ingest.client import SaucerClient
from kiln.workers.lean.client import LeanClient
from kiln.workers.verify.client import VerifyClient

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
CLUSTER = INFRA / "k8s" / "cluster.sh"
KAFKA_PORT, S3_PORT, REGISTRY_PORT, GIT_PORT = 59092, 59570, 59500, 59600
NS = "kiln"
METRICS_PORT = 9400  # the render's default
LEAN_PROOF = "theorem t : p \u2192 p := by\n  intro h\n  exact h"
PHASES = ("up", "apply", "jobs", "replay", "limits", "chain", "spare", "scale")
SPARE_CPU_FRACTION = 1.0  # the node has 2 CPUs: 0.25 or 0.5 would give the 1-slot floor, not the fraction's slots


def sh(*args: str, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 900) -> str:
    done = subprocess.run(list(args), input=stdin, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def cluster(*args: str, **kw: Any) -> str:
    return sh("bash", str(CLUSTER), *args, **kw)


def kubectl(*args: str, **kw: Any) -> str:
    return cluster("kubectl", *args, **kw)


def assignments(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def services(host: str) -> dict[str, str]:
    """Kafka, S3 and the registry, each listening where the pods reach it (the bridge address); their env."""
    kafka = {"KILN_KAFKA_PORT": str(KAFKA_PORT), "KILN_KAFKA_NODES_ADDRESS": host}
    s3 = {"KILN_S3_PORT": str(S3_PORT), "KILN_S3_ADDRESS": host}
    registry = {**s3, "KILN_REGISTRY_PORT": str(REGISTRY_PORT), "KILN_REGISTRY_ADDRESS": host}
    sh("bash", str(INFRA / "kafka/kafka.sh"), "start", env=kafka)
    sh("bash", str(INFRA / "s3/s3.sh"), "start", env=s3)
    sh("bash", str(INFRA / "registry/registry.sh"), "start", env=registry)
    return {**assignments(sh("bash", str(INFRA / "s3/s3.sh"), "env", env=s3)),
            **assignments(sh("bash", str(INFRA / "registry/registry.sh"), "env", env=registry))}


def in_registry(ref: str, push_env: dict[str, str]) -> bool:
    """The registry has ``ref`` (HOST:PORT/NAME:TAG) already (GBs of toolchain are not pushed twice)."""
    address, _, rest = ref.partition("/")
    name, _, tag = rest.rpartition(":")
    request = urllib.request.Request(f"http://{address}/v2/{name}/manifests/{tag}", method="HEAD", headers={
        "Accept": "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json",
        "Authorization": "Basic " + base64.b64encode(
            f"{push_env['KILN_K8S_PUSH_USER']}:{push_env['KILN_K8S_PUSH_PASSWORD']}".encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def smoke_values(host: str, refs: dict[str, str], env: dict[str, str], scale_to: int) -> dict[str, Any]:
    """Every stage's pods at 100m CPU (requests only) and 512 MiB, exec up to ``scale_to``; KEDA and the autoscaler
    polled every 10 s, a 30 s scale-down window; the rootful engine (this node is cgroup v1)."""
    registry = f"{host}:{REGISTRY_PORT}"
    stages: dict[str, Any] = {kind: {"slots": 1, "cpu": "100m", "memory_per_slot_mib": 512, "max_workers": 1}
                              for kind in stage_specs()}
    stages["sleep"].update(min_workers=2, max_workers=2)
    stages["exec"].update(max_workers=scale_to, env={
        "KILN_EXEC_WARM": "0", "KILN_EXEC_REGISTRY": registry,
        "KILN_EXEC_IMAGE_PREFIXES": json.dumps(["kiln/", f"{registry}/"]),
        "KILN_EXEC_REGISTRY_USER": env.get("KILN_BUILD_REGISTRY_USER", "kiln"),
        "KILN_EXEC_REGISTRY_PASSWORD": env.get("KILN_BUILD_REGISTRY_PASSWORD", "")})
    stages["ingest"].update(env={"KILN_INGEST_ALLOW_HOSTS": json.dumps([host])})
    stages["build"].update(env={"KILN_BUILD_REGISTRY": registry,
                                "KILN_BUILD_BASE_IMAGE": f"{registry}/kiln/base:latest",
                                "KILN_BUILD_TOOLCHAIN_IMAGE": f"{registry}/kiln/toolchain:latest",
                                "KILN_BUILD_REGISTRY_USER": env.get("KILN_BUILD_REGISTRY_USER", "kiln"),
                                "KILN_BUILD_REGISTRY_PASSWORD": env.get("KILN_BUILD_REGISTRY_PASSWORD", "")})
    stages["lean"].update(env={"KILN_LEAN_REPL": "/usr/bin/python3 /opt/kiln/fakes/lean_repl.py",
                               "KILN_LEAN_SANDBOX_READONLY": json.dumps(["/opt/kiln/fakes"])})
    return {"namespace": NS, "image": refs["worker"], "engine_image": refs["engine"],
            "engine_rootful": "rootful" in refs["engine"], "engine_args": ["--insecure-registry", registry],
            "image_pull_policy": "Never", "cpu_limits": False, "service_cpu": "50m", "service_memory_mib": 512,
            "bootstrap_servers": f"{host}:{KAFKA_PORT + 3}", "s3_endpoint": env["KILN_S3_ENDPOINT"],
            "control_plane_cidrs": [f"{host}/32"], "control_plane_ports": [KAFKA_PORT + 3, S3_PORT, REGISTRY_PORT],
            "goal_minutes": 0.5, "autoscaler_tick_s": 10, "polling_interval_s": 10, "scale_down_window_s": 30,
            "stages": stages, "spare_cpu": {"cpu_fraction": SPARE_CPU_FRACTION}}


def ready_replicas(deployment: str) -> int:
    out = kubectl("-n", NS, "get", "deploy", deployment, "-o", "jsonpath={.status.readyReplicas}")
    return int(out or 0)


# ---- phases ------------------------------------------------------------------------------------------------------


def apply(host: str, refs: dict[str, str], env: dict[str, str], scale_to: int, metrics: dict[str, float],
          notes: dict[str, str]) -> None:
    values = smoke_values(host, refs, env, scale_to)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "kiln-k8s-values.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    rendered = sh(str(ROOT / ".venv/bin/kiln"), "k8s", "render", str(path))
    began = time.monotonic()
    kubectl("apply", "-f", "-", stdin=rendered.split("---\n", 1)[0])  # the namespace, then its secrets, then all
    for name, data in (("kiln-s3", {"KILN_S3_ACCESS_KEY": env["KILN_S3_ACCESS_KEY"],
                                    "KILN_S3_SECRET_KEY": env["KILN_S3_SECRET_KEY"]}),
                       ("kiln-saucer", {"token": uuid.uuid4().hex})):
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS},
                  "stringData": data}
        kubectl("apply", "-f", "-", stdin=json.dumps(secret))
    console.print(kubectl("apply", "-f", "-", stdin=rendered))
    names = kubectl("-n", NS, "get", "deploy", "-o", "name").split()
    available = []
    for name in names:  # each on its own: one that never comes up is named, the others still count
        try:
            kubectl("-n", NS, "wait", "--for=condition=Available", name, "--timeout=300s", timeout=360)
            available.append(name)
        except RuntimeError:
            notes[f"not Available: {name}"] = kubectl("-n", NS, "get", "pods", "-l",
                                                      f"app.kubernetes.io/name={name.split('/')[-1]}")[-300:]
    metrics["k8s_deployments_available_s"] = time.monotonic() - began
    metrics["k8s_deployments_available"] = float(len(available))
    metrics["k8s_deployments"] = float(len(names))
    kubectl("-n", NS, "rollout", "status", "ds/kiln-spare-lean", "--timeout=300s", timeout=360)


async def jobs(settings: KilnSettings, session_image: str, metrics: dict[str, float], notes: dict[str, str]) -> None:
    async with KilnClient(settings, "k8s-bench-jobs") as kiln:
        for name, job in (
                ("echo", kiln.call("echo", EchoRequest(data="k8s"))),
                ("lean", LeanClient(kiln).run_code(LEAN_PROOF)),
                ("verify", VerifyClient(kiln).verify(RolloutTask(task_id="k8s", prompt="2+2", answer="4"), ["4"])),
                ("exec", ExecClient(kiln).run_once(session_image, "echo from-the-sandbox; id -u"))):
            began = time.monotonic()
            try:
                result = await asyncio.wait_for(job, 300)
                metrics[f"k8s_job_{name}_s"] = time.monotonic() - began
                notes[f"job {name}"] = str(result)[:160]
            except Exception as e:  # a stage that failed is reported, the others still run
                metrics[f"k8s_job_{name}_s"] = float("nan")
                notes[f"job {name}"] = f"FAILED: {type(e).__name__}: {e}"[:300]


def busy_sleep_pod() -> str | None:
    """The sleep pod running a job now: its worker's ``kiln_busy_slots`` (read from its pod IP, as Prometheus does)."""
    listing = kubectl("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kiln-worker-sleep", "-o",
                      'jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{"\\n"}{end}')
    for line in listing.splitlines():
        name, _, ip = line.partition(" ")
        try:
            with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=5) as page:
                text = page.read().decode()
        except OSError:
            continue
        if any(row.startswith("kiln_busy_slots") and float(row.split()[-1]) >= 1 for row in text.splitlines()):
            return name
    return None


async def replay(settings: KilnSettings, metrics: dict[str, float], notes: dict[str, str]) -> None:
    async with KilnClient(settings, "k8s-bench-replay") as kiln:
        victim_job = await kiln.submit("sleep", SleepRequest(seconds=20, tag="preempted"))
        pods: list[str | None] = [None]

        def started() -> bool:
            pods[0] = busy_sleep_pod()
            return pods[0] is not None

        await until(started, "the long job started", 120, 2.0)
        others = [await kiln.submit("sleep", SleepRequest(seconds=1, tag=f"bg{i}"), key=f"bg{i}") for i in range(20)]
        deleted = time.monotonic()
        kubectl("-n", NS, "delete", "pod", str(pods[0]), "--grace-period=0", "--force")
        answered = 0
        try:
            envelope = await asyncio.wait_for(victim_job, 600)
            metrics["k8s_replay_s"] = time.monotonic() - deleted
            result = kiln.result_of(envelope)
            answered += envelope.status == "ok"
            notes["replayed job"] = f"deleted pod {pods[0]}; answered by {result.worker} attempt {result.attempt}"
        except Exception as e:
            metrics["k8s_replay_s"] = float("nan")
            notes["replayed job"] = f"FAILED: {type(e).__name__}: {e}"[:300]
        done = await asyncio.wait_for(asyncio.gather(*others, return_exceptions=True), 600)
        answered += sum(1 for r in done if not isinstance(r, BaseException) and r.status == "ok")
        metrics["k8s_lost_jobs"] = float(21 - answered)


# Bounded bombs (this machine is shared): 512 MiB in 16 MiB steps, each step printed; at most 200 processes.
MEMORY_BOMB = ("python3 -c \"chunks = []\nfor i in range(32):\n    chunks.append(bytearray(16 << 20))\n"
               "    print((i + 1) * 16, flush=True)\"")
CGROUP_PROBE = ("cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max "
                "/sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max 2>&1")
FORK_BOMB = ("python3 -c \"import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
             "            time.sleep(3); os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('refused', e)\n"
             "print('forked', n)\"")
SPIN = "python3 -c \"import time\nt = time.time()\nwhile time.time() - t < 3: pass\""


async def limits(settings: KilnSettings, session_image: str, metrics: dict[str, float], notes: dict[str, str]) -> None:
    async with KilnClient(settings, "k8s-bench-limits") as kiln:
        client = ExecClient(kiln)
        probe = await client.run_once(session_image, CGROUP_PROBE,
                                      limits=SessionLimits(memory_mb=64, pids=32, cpus=0.25), timeout_s=30)
        memory = await client.run_once(session_image, MEMORY_BOMB, limits=SessionLimits(memory_mb=64), timeout_s=30)
        forks = await client.run_once(session_image, FORK_BOMB, limits=SessionLimits(pids=32), timeout_s=30)
        spin = await client.run_once(session_image, SPIN, limits=SessionLimits(cpus=0.25), timeout_s=30)
    mem_out, fork_out = memory.output, forks.output
    reached = max((int(line) for line in (mem_out.stdout if mem_out else "").split() if line.isdigit()), default=0)
    metrics["k8s_sandbox_memory_reached_mib"] = float(reached)
    metrics["k8s_sandbox_memory_enforced"] = float(mem_out is not None and reached < 96)
    forked = next((int(w.split()[1]) for w in (fork_out.stdout if fork_out else "").splitlines()
                   if w.startswith("forked")), -1)
    metrics["k8s_sandbox_pids_forked"] = float(forked)
    metrics["k8s_sandbox_pids_enforced"] = float(0 <= forked < 32)
    step = spin.steps[0] if spin.steps else None
    share = step.cpu_s / step.duration_s if step and step.duration_s else float("nan")
    metrics["k8s_sandbox_cpu_share"] = share
    metrics["k8s_sandbox_cpu_enforced"] = float(share < 0.4)
    notes["cgroup files in the sandbox"] = " ".join((probe.output.stdout if probe.output else "").split())[:300]
    notes["memory bomb"] = str(mem_out)[:200]
    notes["fork bomb"] = str(fork_out)[:200]


# A build step's view from a build pod's engine (its kiln-egress network): allowlisted registries through the proxy,
# everything else refused; Kafka, the API server, services, the pod itself and the gateway's other ports unreachable.
EGRESS_PROBE = """
import socket, urllib.request
proxy = urllib.request.build_opener(urllib.request.ProxyHandler(
    {"http": "http://172.31.250.1:3128", "https": "http://172.31.250.1:3128"}))
for url in ("https://pypi.org/simple/pip/", "https://github.com/"):
    try:
        print("proxy", url, proxy.open(url, timeout=30).status)
    except Exception as e:
        print("proxy", url, "refused", str(e)[:60].replace(" ", "_"))
for target in %s:
    try:
        socket.create_connection(target, timeout=3).close()
        print("direct", "%%s:%%d" %% target, "OPEN")
    except OSError:
        print("direct", "%%s:%%d" %% target, "closed")
"""


def egress_probe(host: str, image: str, metrics: dict[str, float], notes: dict[str, str]) -> None:
    pod = kubectl("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kiln-worker-build", "-o",
                  'jsonpath={.items[0].metadata.name} {.items[0].status.podIP}').split()
    targets = [(host, KAFKA_PORT + 3), (host, S3_PORT), (host, REGISTRY_PORT), (host, 6443), ("10.96.0.1", 443),
               (pod[1], METRICS_PORT), ("172.31.250.1", METRICS_PORT), ("1.1.1.1", 443)]
    out = kubectl("-n", NS, "exec", pod[0], "-c", "engine", "--", "docker", "-H", "unix:///run/kiln-engine/docker.sock",
                  "run", "--rm", "--network", "kiln-egress", "--user", "1000", image, "python3", "-c",
                  EGRESS_PROBE % repr(targets), timeout=180)
    lines = [line.split() for line in out.splitlines() if line.startswith(("proxy", "direct"))]
    metrics["k8s_egress_registry_ok"] = float(any(w[1].startswith("https://pypi.org") and w[2] == "200" for w in lines))
    metrics["k8s_egress_other_refused"] = float(any(w[1].startswith("https://github.com") and w[2] == "refused"
                                                    for w in lines))
    metrics["k8s_egress_direct_open"] = float(sum(1 for w in lines if w[0] == "direct" and w[2] == "OPEN"))
    notes["egress from a build pod's engine"] = " ".join(" ".join(w[1:]) for w in lines)[:400]


async def chain(settings: KilnSettings, host: str, metrics: dict[str, float], notes: dict[str, str]) -> None:
    story = Story(settings, DemoSettings(), console)  # the demo's repository, checkout and candidate patches
    story.work = Path(os.environ.get("TMPDIR", "/tmp")) / "kiln-k8s-chain"
    checkout = story._checkout()
    patches = [story._patch(checkout, c) for c in CANDIDATES]
    daemon = await asyncio.create_subprocess_exec(
        "git", "daemon", "--reuseaddr", "--export-all", f"--listen={host}", f"--port={GIT_PORT}",
        f"--base-path={story.work}", str(story.work), stderr=subprocess.DEVNULL)
    steps: list[tuple[str, float]] = []
    try:
        async with KilnClient(settings, "k8s-bench-chain") as kiln:
            began = time.monotonic()
            ingested = await SaucerClient(kiln).ingest_repository(
                IngestRequest(name=NAME, location=f"git://{host}:{GIT_PORT}/calc"))
            steps.append(("ingest", time.monotonic() - began))
            notes["chain ingest"] = f"{ingested.status}: {ingested.commits} commits, refs {sorted(ingested.refs)}"
            began = time.monotonic()
            # Layered: the image is pushed to the registry, where the exec pods' engines pull it (the build pod's
            # engine is not theirs).
            built = await BuilderClient(kiln).build(BuildRequest(repository=NAME, layered=True))
            steps.append(("build", time.monotonic() - began))
            notes["chain build"] = f"usable={built.usable} image={built.image} {built.failure}: {built.detail}"[:300]
            await asyncio.to_thread(egress_probe, host, f"{host}:{REGISTRY_PORT}/kiln/base:latest", metrics, notes)
            # The build pod's engine holds the toolchain and the build (GBs); the exec pod pulls the image again.
            await asyncio.to_thread(release_engines, "kiln-worker-build", notes)
            if built.image is None:
                return
            began = time.monotonic()
            execs = ExecClient(kiln)
            session = await execs.open_session(built.image, repository=NAME)
            try:
                ran = await execs.run_tests(session)
            finally:
                await execs.close_session(session)
            steps.append(("exec", time.monotonic() - began))
            tests = ran.tests
            notes["chain exec"] = f"tests passed {tests and tests.passed} failed {tests and tests.failed}"
            began = time.monotonic()
            task = RolloutTask(task_id="calc-mul", prompt="Fix calc.mul.", verifier="tests",
                               check={"image": built.image})
            verdicts = await VerifyClient(kiln).verify(task, patches)
            steps.append(("verify", time.monotonic() - began))
            notes["chain verify"] = ", ".join(f"{c.label}: {v.reward:.2f}" for c, v in
                                              zip(CANDIDATES, verdicts, strict=True))[:300]
    finally:
        daemon.terminate()
        await daemon.wait()
        for name, seconds in steps:
            metrics[f"k8s_chain_{name}_s"] = seconds
        await asyncio.to_thread(release_engines, "kiln-worker-exec", notes)


def release_engines(deployment: str, notes: dict[str, str]) -> None:
    """The chain leaves GBs in the build and exec pods' engines (emptyDirs: the toolchain and the build, the built
    image's pull): the deployment's pods are replaced, which frees them on this shared disk (the build's before the
    exec pod pulls: both at once took its last 9 GB), and later phases run on fresh ones."""
    before = shutil.disk_usage("/").free
    kubectl("-n", NS, "delete", "pod", "-l", f"app.kubernetes.io/name={deployment}", "--wait=true", timeout=300)
    notes[f"disk freed: {deployment}"] = f"{(shutil.disk_usage('/').free - before) / 2**30:.1f} GiB"


def stats_workers() -> dict[str, Any]:
    """The stats app's last heartbeat of each worker (its /workers page, from its pod's IP)."""
    ip = kubectl("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kiln-stats", "-o",
                 "jsonpath={.items[0].status.podIP}")
    with urllib.request.urlopen(f"http://{ip}:{STATS_PORT}/workers", timeout=10) as page:
        workers: dict[str, Any] = json.loads(page.read())
    return workers


async def spare(settings: KilnSettings, metrics: dict[str, float], notes: dict[str, str]) -> None:
    pod = kubectl("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kiln-spare-lean", "-o",
                  "jsonpath={.items[0].metadata.name}")
    cpus = int(kubectl("get", "nodes", "-o", "jsonpath={.items[0].status.capacity.cpu}"))
    beats = [b for w, b in (await asyncio.to_thread(stats_workers)).items() if w.startswith(f"{pod}-")]
    metrics["k8s_spare_slots"] = float(beats[0]["slots"]) if beats else float("nan")
    metrics["k8s_spare_expected_slots"] = float(max(1, int(cpus * SPARE_CPU_FRACTION)))
    notes["spare-CPU pod"] = f"{pod}: heartbeat {beats[0] if beats else 'none'}"[:300]
    burst = 16
    async with KilnClient(settings, "k8s-bench-spare") as kiln:
        futures = [await kiln.submit("lean", LeanRequest(op="run_code", code=LEAN_PROOF), key=f"spare-{i}")
                   for i in range(burst)]
        envelopes = await asyncio.wait_for(asyncio.gather(*futures), 300)
    by_worker: dict[str, int] = {}
    for envelope in envelopes:
        by_worker[envelope.worker.rsplit("-", 2)[0]] = by_worker.get(envelope.worker.rsplit("-", 2)[0], 0) + 1
    metrics["k8s_spare_burst"] = float(burst)
    metrics["k8s_spare_lean_jobs"] = float(by_worker.get(pod, 0))
    metrics["k8s_spare_lean_ok"] = float(sum(1 for e in envelopes if e.status == "ok"))
    notes["lean burst answered by"] = json.dumps(by_worker)


def hpa_rescales(name: str) -> list[str]:
    """The HPA's SuccessfulRescale events: what KEDA's HPA did to the replica count."""
    events = json.loads(kubectl("-n", NS, "get", "events", "--field-selector",
                                f"involvedObject.name={name},reason=SuccessfulRescale", "-o", "json"))["items"]
    return [e["message"].split(";")[0] for e in sorted(events, key=lambda e: e.get("lastTimestamp") or "")]


async def scale(settings: KilnSettings, session_image: str, scale_to: int, metrics: dict[str, float],
                notes: dict[str, str]) -> None:
    await until(lambda: ready_replicas("kiln-worker-exec") == 1, "exec at 1 Ready replica", 600, 2.0)
    metrics["k8s_scale_disk_free_gib"] = shutil.disk_usage("/").free / 2**30  # each new exec pod pulls its image
    async with KilnClient(settings, "k8s-bench-scale") as kiln:
        client = ExecClient(kiln)
        began = time.monotonic()
        samples: list[tuple[float, int]] = []  # (seconds since the queue began, Ready replicas)

        async def sample() -> None:
            while True:
                samples.append((time.monotonic() - began, await asyncio.to_thread(ready_replicas, "kiln-worker-exec")))
                await asyncio.sleep(2)

        sampler = asyncio.ensure_future(sample())
        queue = [asyncio.ensure_future(client.run_once(session_image, "sleep 5", timeout_s=60)) for _ in range(45)]
        try:
            metrics["k8s_scale_up_s"] = await until(
                lambda: ready_replicas("kiln-worker-exec") >= scale_to, f"exec at {scale_to} Ready replicas", 900, 2.0)
        except RuntimeError as e:
            metrics["k8s_scale_up_s"] = float("nan")
            notes["scale up"] = str(e)
        hpa = kubectl("-n", NS, "get", "hpa", "keda-hpa-kiln-worker-exec", "-o", "json")
        status = json.loads(hpa)["status"]
        notes["HPA made by KEDA"] = f"desired {status.get('desiredReplicas')} current {status.get('currentReplicas')}"
        results = await asyncio.gather(*queue, return_exceptions=True)
        drained = time.monotonic()
        metrics["k8s_scale_queue_s"] = drained - began
        failed = [r for r in results if isinstance(r, BaseException)]
        metrics["k8s_scale_jobs_failed"] = float(len(failed))
        if failed:
            notes["scale: a failed job"] = f"{type(failed[0]).__name__}: {failed[0]}"[:300]
    try:
        metrics["k8s_scale_down_s"] = await until(
            lambda: ready_replicas("kiln-worker-exec") == 1, "exec back to 1 Ready replica", 600, 2.0)
    except RuntimeError as e:
        metrics["k8s_scale_down_s"] = float("nan")
        notes["scale down"] = str(e)
    sampler.cancel()
    peak = max(samples, key=lambda t: t[1], default=(0.0, 0))
    metrics["k8s_scale_peak_replicas"] = float(peak[1])
    # The Harmonic rule lowers the minimum once the queue clears within a minute at the current rate (Lq < Rmin):
    # exec may be back at 1 before the queue is empty.
    metrics["k8s_scale_back_to_1_s"] = next((t for t, n in samples if t > peak[0] and n == 1), float("nan"))
    notes["exec Ready replicas (s: n)"] = " ".join(f"{t:.0f}:{n}" for i, (t, n) in enumerate(samples)
                                                    if i == 0 or n != samples[i - 1][1])[:300]
    rescales = hpa_rescales("keda-hpa-kiln-worker-exec")
    metrics["k8s_hpa_rescales"] = float(len(rescales))
    notes["HPA rescales"] = " | ".join(rescales)[:400]


# ---- main --------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--scale-to", type=int, default=3)
    parser.add_argument("--down", action="store_true", help="Tear the cluster and its services down at the end.")
    args = parser.parse_args()
    phases = args.phases.split(",")
    metrics: dict[str, float] = {}
    notes: dict[str, str] = {}
    if "up" in phases:
        began = time.monotonic()
        refs = assignments(cluster("images", timeout=3600))
        metrics["k8s_images_s"] = time.monotonic() - began
        began = time.monotonic()
        cluster("up", timeout=1200)
        metrics["k8s_up_s"] = time.monotonic() - began
    refs = assignments(cluster("images", timeout=3600))
    host = assignments(cluster("env"))["KILN_K8S_HOST_ADDRESS"]
    env = services(host)
    os.environ.update({"KILN_BOOTSTRAP_SERVERS": f"127.0.0.1:{KAFKA_PORT}", "KILN_BLOB_STORE": "s3://kiln/blobs",
                       **{k: v for k, v in env.items() if k.startswith("KILN_S3_")}})
    sh(str(ROOT / ".venv/bin/kiln"), "init")
    settings = KilnSettings()
    # The exec sessions' image, in the registry the exec pods' engines pull from.
    session_image = f"{host}:{REGISTRY_PORT}/kiln/base:latest"
    push_env = {"KILN_K8S_PUSH_USER": env["KILN_BUILD_REGISTRY_USER"],
                "KILN_K8S_PUSH_PASSWORD": env["KILN_BUILD_REGISTRY_PASSWORD"]}
    cluster("push", "kiln/base:latest", session_image, env=push_env)
    toolchain = f"{host}:{REGISTRY_PORT}/kiln/toolchain:latest"
    if "chain" in phases and not in_registry(toolchain, push_env):  # the build pod's engine pulls its bases there
        cluster("push", "kiln/toolchain:latest", toolchain, env=push_env, timeout=1800)
    try:
        if "apply" in phases:
            try:
                apply(host, refs, env, args.scale_to, metrics, notes)
            except RuntimeError as e:  # what did not come up is reported; the phases show what still works
                notes["phase apply"] = f"FAILED: {e}"[:400]
                console.print(kubectl("get", "pods", "-A", "-o", "wide"))
        runs: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
            "jobs": lambda: jobs(settings, session_image, metrics, notes),
            "replay": lambda: replay(settings, metrics, notes),
            "limits": lambda: limits(settings, session_image, metrics, notes),
            "chain": lambda: chain(settings, host, metrics, notes),
            "spare": lambda: spare(settings, metrics, notes),
            "scale": lambda: scale(settings, session_image, args.scale_to, metrics, notes)}
        for name, phase in runs.items():
            if name in phases:
                began = time.monotonic()
                try:
                    asyncio.run(phase())
                except Exception as e:
                    notes[f"phase {name}"] = f"FAILED: {type(e).__name__}: {e}"[:400]
                metrics[f"k8s_phase_{name}_s"] = time.monotonic() - began
    finally:
        report("kiln on Kubernetes (one node, this machine)", metrics, notes)
        if args.down:
            cluster("down", timeout=600)
            for script, env_ in (("kafka/kafka.sh", {"KILN_KAFKA_PORT": str(KAFKA_PORT)}),
                                 ("registry/registry.sh", {"KILN_REGISTRY_PORT": str(REGISTRY_PORT)}),
                                 ("s3/s3.sh", {"KILN_S3_PORT": str(S3_PORT)})):
                subprocess.run(["bash", str(INFRA / script), "stop"], env={**os.environ, **env_}, check=False)


if __name__ == "__main__":
    main()
