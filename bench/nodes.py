"""Several worker nodes on one machine, one of them lost whole mid-run (issue 46, item 3).

A node (``infra/nodes/nodes.sh``) is a network namespace with its own Docker engine (own containerd, data root,
bridge), its own egress proxy and packet filter, and its own kiln workers: exec, build and Lean (on the fake REPL,
``tests/fakes/lean_repl.py``). The nodes share only what a real cluster's nodes share, over the nodes' bridge (never
loopback): a Kafka broker or cluster started here with a listener on the bridge, an S3 server (the claim-check store
and Saucer's) and the registry on it. The scenario:

1. **Images only through the registry**: the sandbox image is pushed once to the registry; every node's engine
   starts without it and pulls it by digest on first use (``nodes_pulled_by_digest``: nodes whose engine then holds
   it under that reference). The builders' base and toolchain images likewise: a node's builder pulls them by digest
   (``KILN_BUILD_BASE_IMAGE``/``_TOOLCHAIN_IMAGE`` are registry references) before its first build
   (``nodes_bases_by_digest``: nodes holding the toolchain under its reference).
2. **Each node's egress**: from a sandbox on each node, on the node's egress network (a build step's), direct
   connections to the host's broker, S3 and registry, to the other nodes, and to the internet, and requests through
   the node's proxy for hosts outside its allowlist (``nodes_egress_escapes``: any of those that got through; an
   exec ``run_once`` sandbox, with no network, tries the same); a package registry through the proxy answers
   (``nodes_egress_proxy_allowed``: nodes where it did).
3. **Built on one node, run on another**: a repository revision built as a layered image on one node (pushed to the
   registry by digest) runs in exec ``run_once`` calls on every other node (``nodes_built_here_ran_there``).
4. **Affinity and spill-over**: ``--sessions-per-key`` sessions of one repository gather on one node (one partition
   key); the next one spills to the next key, chosen so that it is owned by another node (``nodes_affinity_ok``,
   ``nodes_spilled_to_other_node``). That node is the victim.
5. **A node lost whole**: ``run_once`` calls (``sleep`` then an answer) are in flight on every node, Lean requests
   (the fake REPL's ``sleep``) on the victim's Lean partitions, and (``--kill-build``) a build whose ``make`` sleeps,
   on the victim's build partition; once the victim holds at least one confirmed in-flight call (a ``sleep`` seen in
   one of its sandboxes), build (its ``sleep`` seen in a build step's container) and its sessions, it is killed
   whole — workers, dockerd, containerd, shims, sandboxes, build steps and its egress proxy frozen and SIGKILLed
   together. Its calls, Lean requests and build replay on the others and complete (``nodes_lost_requests``: requests
   never answered or answered wrongly; ``nodes_lean_replayed`` and ``nodes_builds_replayed``: those of the victim
   answered after its death; ``nodes_duplicate_answers``: result records beyond the first of one request on the
   results topic, read raw, before any client deduplicates); its sessions answer ``SessionLost``
   (``nodes_sessions_lost_answered``, never a hang: ``nodes_sessions_hung``); ``nodes_takeover_s``: from the kill
   until the survivors own every partition of every stage.
6. **The node comes back**: its engine restarts with what the dead workers left (``nodes_leftovers_on_return``, of
   which build containers: ``nodes_build_leftovers_on_return``); its new exec worker's reaper and its new builder
   remove them (``nodes_leaked_containers``: exec or build containers on any node's engine whose worker is dead,
   after ``--settle`` s).
7. **Saucer on every node**, off the shared store (S3): a client reads a file of an ingested repository all along,
   from the nodes in turn, trying the next node when one does not answer (as a Service in front of them would);
   ``nodes_saucer_reads`` and ``nodes_saucer_failed_reads`` (reads no node answered; aim 0) across the node's loss.

Usage: python -m bench.nodes [--nodes 2] [--calls 16] [--sessions-per-key 2] [--brokers 1] [--call-s 6]
       [--lean-s 20] [--kill-build | --no-kill-build] [--build-s 45]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import httpx
import requests
from confluent_kafka import Consumer

from bench.common import console, report, until
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams import admin
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.codec import result_request_id
from kiln.streams.errors import KilnError, RequestFailed
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.builder import leftovers
from kiln.workers.builder.client import BuilderClient
from kiln.workers.common import sandbox
from kiln.workers.exec.client import ExecClient, ExecSession
from kiln.workers.lean.client import LeanClient
from tests.ingest.gitrepos import write
from tests.workers.builder.projects import make_project, python_project
from tests.workers.lean.fake import FAKE_COMMAND, THEOREMS

REPO = Path(__file__).resolve().parents[1]
NODES_SH = REPO / "infra" / "nodes" / "nodes.sh"
TOPICS = {"exec": "exec.requests", "build": "image.build", "lean": "lean.requests"}
EVENTS_TOPIC = "image.events"
RESULTS_TOPIC = "nodes.results"
IMAGE_REPOSITORY = "kiln/nodes-sandbox"
# The builders' bases (KILN_BUILD_BASE_IMAGE, _TOOLCHAIN_IMAGE): the host's local images, as registry repositories.
BASES = {"base": ("kiln/base:latest", "kiln/nodes-base"),
         "toolchain": ("kiln/toolchain:latest", "kiln/nodes-toolchain")}
SAUCER_PORT = 8700
SAUCER_REPOSITORY = "nodes/calc"
EGRESS_GATEWAY, EGRESS_PORT = "172.31.250.1", 3128  # a node's egress proxy (egress.sh's defaults, in the node)
ALLOWED = "pypi.org:443"  # a package registry the proxy lets through
OUTSIDE = ("1.1.1.1", 443), ("8.8.8.8", 53)  # the internet, directly


def script(path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(["bash", str(path), *args], env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{path.name} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


@dataclass
class Shared:
    """What the nodes share: the broker (or cluster), S3 and the registry, on the nodes' bridge address."""

    kafka_port: int
    brokers: int
    s3_port: int
    registry_port: int
    address: str = ""
    secrets: dict[str, str] = field(default_factory=dict)
    bases: dict[str, str] = field(default_factory=dict)  # KILN_BUILD_*_IMAGE: registry references by digest

    def kafka_env(self) -> dict[str, str]:
        return {"KILN_KAFKA_PORT": str(self.kafka_port), "KILN_KAFKA_BROKERS": str(self.brokers),
                "KILN_KAFKA_NODES_ADDRESS": self.address}

    def s3_env(self) -> dict[str, str]:
        return {"KILN_S3_ADDRESS": self.address, "KILN_S3_PORT": str(self.s3_port)}

    def registry_env(self) -> dict[str, str]:
        # The registry listens on every address of the host: the nodes pull over the bridge, the host's engine
        # pushes the seed images over loopback (an engine trusts a plain-HTTP registry only on loopback or when
        # told to, as the nodes' engines are).
        return {**self.s3_env(), "KILN_REGISTRY_ADDRESS": "0.0.0.0", "KILN_REGISTRY_PORT": str(self.registry_port)}

    def start(self) -> None:
        self.address = script(NODES_SH, "address").strip()
        script(NODES_SH, "bridge")
        kafka = REPO / "infra" / "kafka" / "kafka.sh"
        script(kafka, "start", env=self.kafka_env())
        script(REPO / "infra" / "registry" / "registry.sh", "start", env=self.registry_env())
        for line in script(REPO / "infra" / "s3" / "s3.sh", "env", env=self.s3_env()).splitlines():
            key, _, value = line.partition("=")
            self.secrets[key] = value
        for line in script(REPO / "infra" / "registry" / "registry.sh", "env", env=self.registry_env()).splitlines():
            key, _, value = line.partition("=")
            self.secrets[key] = value
        self.bootstrap_nodes = script(kafka, "bootstrap-nodes", env=self.kafka_env()).strip()
        self.bootstrap_host = script(kafka, "bootstrap", env=self.kafka_env()).strip()
        run_steps(COMPONENT_STEPS["lean"])  # the Lean workers' REPL sandbox (bubblewrap)

    def stop(self) -> None:
        script(REPO / "infra" / "kafka" / "kafka.sh", "stop", env=self.kafka_env())

    @property
    def registry(self) -> str:
        return f"{self.address}:{self.registry_port}"

    def host_settings(self) -> KilnSettings:
        return KilnSettings(bootstrap_servers=self.bootstrap_host, blob_store="s3://kiln-nodes/claims",
                            s3_endpoint=self.secrets["KILN_S3_ENDPOINT"],
                            s3_access_key=self.secrets["KILN_S3_ACCESS_KEY"],
                            s3_secret_key=self.secrets["KILN_S3_SECRET_KEY"])

    def node_env(self) -> dict[str, str]:
        """A node worker's environment: everything over the bridge."""
        user, password = self.secrets["KILN_BUILD_REGISTRY_USER"], self.secrets["KILN_BUILD_REGISTRY_PASSWORD"]
        return {"KILN_BOOTSTRAP_SERVERS": self.bootstrap_nodes, "KILN_BLOB_STORE": "s3://kiln-nodes/claims",
                "KILN_S3_ENDPOINT": self.secrets["KILN_S3_ENDPOINT"],
                "KILN_S3_ACCESS_KEY": self.secrets["KILN_S3_ACCESS_KEY"],
                "KILN_S3_SECRET_KEY": self.secrets["KILN_S3_SECRET_KEY"],
                "KILN_EXEC_REGISTRY": self.registry, "KILN_EXEC_REGISTRY_USER": user,
                "KILN_EXEC_REGISTRY_PASSWORD": password,
                "KILN_EXEC_IMAGE_PREFIXES": json.dumps([f"{self.registry}/kiln/"]),
                "KILN_EXEC_REAP_INTERVAL_S": "2", "KILN_EXEC_WARM": "0",
                "KILN_BUILD_REGISTRY": self.registry, "KILN_BUILD_REGISTRY_USER": user,
                "KILN_BUILD_REGISTRY_PASSWORD": password, "KILN_BUILD_AGENT": "false",
                "KILN_BUILD_BASE_IMAGE": self.bases["base"], "KILN_BUILD_TOOLCHAIN_IMAGE": self.bases["toolchain"],
                "KILN_LEAN_REPL": FAKE_COMMAND}

    def auth(self) -> dict[str, str]:
        return {"username": self.secrets["KILN_BUILD_REGISTRY_USER"],
                "password": self.secrets["KILN_BUILD_REGISTRY_PASSWORD"]}


class Node:
    def __init__(self, index: int, shared: Shared) -> None:
        self.index = index
        self.shared = shared
        self.workers: dict[str, WorkerProcess] = {}
        self.servers: list[subprocess.Popen[bytes]] = []
        self.env = dict(line.partition("=")[::2] for line in script(NODES_SH, "env", str(index)).splitlines())
        self.address = self.env["KILN_NODE_ADDRESS"]

    def up(self) -> None:
        script(NODES_SH, "up", str(self.index), env={"KILN_NODES_INSECURE_REGISTRY": self.shared.registry})

    def kill(self) -> None:
        script(NODES_SH, "kill", str(self.index))
        for proc in [w.proc for w in self.workers.values()] + self.servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.workers.clear()
        self.servers.clear()

    def serve_saucer(self, token: str) -> str:
        """Saucer's HTTP API on this node's address, off the shared store; its base URL."""
        log = Path(tempfile.gettempdir()) / f"kiln-node{self.index}-saucer-{time.monotonic_ns()}.log"
        env = {**os.environ, **self.shared.node_env(), "KILN_SAUCER_TOKEN": token}
        self.servers.append(subprocess.Popen(
            ["bash", str(NODES_SH), "run", str(self.index), sys.executable, "-m", "kiln.streams.cli", "saucer",
             "serve", "--host", self.address, "--port", str(SAUCER_PORT)],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT))
        return f"http://{self.address}:{SAUCER_PORT}"

    def stop_servers(self) -> None:
        for proc in self.servers:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            proc.kill()
        self.servers.clear()

    def engine(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.env["DOCKER_HOST"], timeout=60)

    def start_workers(self, settings: KilnSettings, slots: dict[str, int]) -> None:
        """An exec, a build and a Lean worker in this node (each its own process, its own consumer group member)."""
        for stage, topic in TOPICS.items():
            self.workers[stage] = WorkerProcess(stage, settings, settings.topic(topic), slots=slots[stage],
                                                grace_s=10, env=self.shared.node_env(), group=f"nodes-{stage}",
                                                launcher=["bash", str(NODES_SH), "run", str(self.index)])

    def wait_assigned(self, timeout: float) -> None:
        for worker in self.workers.values():
            worker.wait_assigned(timeout)

    def owned(self, stage: str) -> set[int]:
        """The partitions of ``stage`` this node's live worker holds, from its log: an assignment adds partitions,
        a revocation or a loss takes them away (incremental, as the group hands them over)."""
        worker = self.workers.get(stage)
        if worker is None or worker.proc.poll() is not None:
            return set()
        held: set[int] = set()
        for change, listed in re.findall(r"\b(assigned|revoked|lost) \[([0-9, ]*)\]", worker.log.read_text()):
            partitions = {int(p) for p in listed.split(",") if p.strip()}
            held = held | partitions if change == "assigned" else held - partitions
        return held

    def holds(self, reference: str) -> bool:
        """This node's engine holds an image under ``reference`` (``registry/name@sha256:...``)."""
        return any(reference in i.attrs.get("RepoDigests", []) for i in self.engine().images.list())

    def clean(self) -> None:
        """Start from an engine with no container and no copy of the sandbox image (so it must be pulled). Images
        are removed by reference, never by id: an id may be shared by other references (the base image pushed as
        the builders' base) or be the parent of images built on the node, and the engine refuses to remove it."""
        engine = self.engine()
        for c in engine.containers.list(all=True):
            with contextlib.suppress(docker.errors.APIError):
                c.remove(force=True, v=True)
        for image in engine.images.list():
            for ref in image.attrs.get("RepoDigests", []) + image.tags:
                if ref.startswith(f"{self.shared.registry}/{IMAGE_REPOSITORY}"):
                    with contextlib.suppress(docker.errors.NotFound):
                        engine.images.remove(ref)

    def forget_builds(self) -> None:
        """The revision images this run built or pulled here, removed by reference (the dependency images stay:
        the node's build cache, as on a real node's disk). The toolchain's reference is taken first where the
        node lacks it (its layers are here: nothing is downloaded), so that removing a revision image never
        removes the toolchain's layers under it with it."""
        engine = docker.DockerClient(base_url=self.env["DOCKER_HOST"], timeout=600)
        toolchain = self.shared.bases["toolchain"]
        if not self.holds(toolchain) and any(ref.startswith(f"{self.shared.registry}/kiln/rev/")
                                             for i in engine.images.list() for ref in i.attrs.get("RepoDigests", [])):
            engine.images.pull(toolchain, auth_config=self.shared.auth())
        for image in engine.images.list():
            for ref in image.attrs.get("RepoDigests", []) + image.tags:
                if ref.startswith((f"{self.shared.registry}/kiln/rev/", "kiln/build/nodes-")):
                    with contextlib.suppress(docker.errors.APIError):
                        engine.images.remove(ref)


def seed_images(shared: Shared) -> str:
    """kiln's base image pushed to the registry as the sandbox image, and the base and toolchain images as the
    builders' bases (over loopback, from the host's engine); the sandbox image's reference by digest as the nodes
    see it (the bases' are in ``shared.bases``)."""
    run_steps(COMPONENT_STEPS["docker"])
    host = docker.from_env(timeout=1800)

    def push(local_image: str, repository: str) -> str:
        image = host.images.get(local_image)
        tag = image.id.split(":")[1][:12]
        local = f"127.0.0.1:{shared.registry_port}/{repository}"
        image.tag(local, tag)
        for line in host.images.push(local, tag, auth_config=shared.auth(), stream=True, decode=True):
            if "error" in line:
                raise RuntimeError(f"push failed: {line['error']}")
        digest = host.images.get_registry_data(f"{local}:{tag}", auth_config=shared.auth()).id
        host.images.remove(f"{local}:{tag}")  # the host's engine keeps no reference of its own to the copies
        return f"{shared.registry}/{repository}@{digest}"

    shared.bases = {kind: push(local, repository) for kind, (local, repository) in BASES.items()}
    return push(BASES["base"][0], IMAGE_REPOSITORY)


@dataclass
class SaucerReader:
    """Reads one file again and again from the nodes in turn; a node that does not answer is skipped for the next."""

    urls: list[str]
    token: str
    expected: bytes
    reads: int = 0
    failed: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        path = f"/repos/{SAUCER_REPOSITORY}/-/files/calc/__init__.py"
        turn = 0
        async with httpx.AsyncClient(timeout=3.0, headers=headers) as http:
            while not stop.is_set():
                self.reads += 1
                for attempt in range(len(self.urls)):
                    url = self.urls[(turn + attempt) % len(self.urls)]
                    with contextlib.suppress(httpx.HTTPError):
                        response = await http.get(url + path)
                        if response.status_code == 200 and response.content == self.expected:
                            break
                else:
                    self.failed += 1
                turn += 1
                await asyncio.sleep(0.1)


async def ingest_into(store: SaucerStore, name: str, source: Path, work: Path) -> None:
    event = await ingest(IngestRequest(name=name, location=str(source)), name.replace("/", "-"), store, work)
    assert event.status == "ingested", event


async def saucer_on_every_node(store: SaucerStore, nodes: list[Node], work: Path) -> SaucerReader:
    """A repository ingested into the shared store, Saucer served from every node, a reader started."""
    python_project(work / "src")
    await ingest_into(store, SAUCER_REPOSITORY, work / "src", work / "ingest")
    token = uuid.uuid4().hex
    urls = [n.serve_saucer(token) for n in nodes]
    expected = (work / "src" / "calc" / "__init__.py").read_bytes()

    def serving() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return all(httpx.get(f"{u}/healthz", timeout=2).status_code == 200 for u in urls)
        return False

    await until(serving, "Saucer answering on every node", 60)
    return SaucerReader(urls, token, expected)


def settled(nodes: list[Node], partitions: int, stages: tuple[str, ...] = tuple(TOPICS)) -> bool:
    """For each stage, every partition owned by exactly one node, and every node owning some."""
    for stage in stages:
        owned = [n.owned(stage) for n in nodes]
        if not (all(owned) and sum(map(len, owned)) == partitions and set().union(*owned) == set(range(partitions))):
            return False
    return True


def partition_of(key: str, partitions: int) -> int:
    """librdkafka's default partitioner (consistent_random: CRC32 of the key)."""
    return zlib.crc32(key.encode()) % partitions


def spill_repository(nodes: list[Node], partitions: int) -> str:
    """A repository name whose first key and spill-over key are owned by different nodes."""
    owner = {p: n.index for n in nodes for p in n.owned("exec")}
    for i in range(10_000):
        name = f"repo-{i}"
        first, spill = partition_of(f"{name}#0", partitions), partition_of(f"{name}#1", partitions)
        if owner.get(first) and owner.get(spill) and owner[first] != owner[spill]:
            return name
    raise RuntimeError(f"no repository spills to another node: ownership {owner}")


def keys_on(node: Node, stage: str, partitions: int, prefix: str, count: int) -> list[str]:
    """``count`` keys (``prefix``-i) whose partitions ``node`` owns for ``stage``."""
    owned = node.owned(stage)
    keys = [f"{prefix}-{i}" for i in range(10_000) if partition_of(f"{prefix}-{i}", partitions) in owned]
    if len(keys) < count:
        raise RuntimeError(f"node {node.index} owns no {stage} partition")
    return keys[:count]


def where(nodes: list[Node], container: str) -> int:
    """The node whose engine runs ``container`` (a session's hostname: its container's short id); 0 for none."""
    for n in nodes:
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError, docker.errors.DockerException):
            if n.engine().containers.get(container).status == "running":
                return n.index
    return 0


def running(node: Node, marker: str, label: str | None = None) -> bool:
    """A running container of the node (of role ``label``, if given) has a process whose command line holds
    ``marker`` (a confirmed in-flight call or build step)."""
    filters = {"label": f"kiln.role={label}"} if label else {}
    with contextlib.suppress(docker.errors.APIError, docker.errors.DockerException):
        for c in node.engine().containers.list(filters=filters):
            with contextlib.suppress(docker.errors.APIError):
                if any(marker in " ".join(p) for p in c.top().get("Processes") or []):
                    return True
    return False


def lock_dead(path: Path) -> bool:
    """The worker holding ``path`` is gone (the lock can be taken); judged without removing anything."""
    try:
        with path.open() as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True
    except FileNotFoundError:
        return True


def leaked(nodes: list[Node]) -> tuple[int, int]:
    """Containers on the nodes' engines whose worker is dead: (exec sessions and runners, build containers)."""
    exec_left = build_left = 0
    for n in nodes:
        engine = n.engine()
        exec_left += sum(lock_dead(Path(c.labels.get("kiln.lock", "")))
                         for c in engine.containers.list(all=True, filters={"label": "kiln.role=exec-session"}))
        parent, locks = n.env["KILN_BUILD_CGROUP"], Path(n.env["KILN_BUILD_LOCK_DIR"])
        for c in engine.containers.list(all=True):
            worker = leftovers.owner(c.attrs, parent)
            build_left += worker is not None and lock_dead(locks / f"{worker}.lock")
    return exec_left, build_left


def raw_results(settings: KilnSettings, topic: str) -> Counter[str]:
    """Result records per request id on the results topic, read whole."""
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"nodes-raw-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    counts: Counter[str] = Counter()
    try:
        consumer.subscribe([topic])
        idle_until = time.monotonic() + 10
        while time.monotonic() < idle_until:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            idle_until = time.monotonic() + 3
            request_id = result_request_id(msg.value() or b"", msg.headers())
            if request_id is not None:
                counts[request_id] += 1
    finally:
        consumer.close()
    return counts


# Run in a sandbox of a node: each attempt that must fail, and whether it got through (JSON on stdout).
PROBE = """import json, socket, sys
plan = json.loads(sys.argv[1])
def direct(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False
def proxied(target):
    try:
        s = socket.create_connection(tuple(plan["proxy"]), timeout=5)
        s.settimeout(15)
        s.sendall(("CONNECT %s HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % (target, target)).encode())
        line = s.recv(256).split(b"\\r\\n")[0].decode(errors="replace").split()
        s.close()
        return line[1] if len(line) > 1 else "?"
    except OSError:
        return "unreachable"
print(json.dumps({"direct": {"%s:%s" % tuple(t): direct(*t) for t in plan["direct"]},
                  "proxied": {t: proxied(t) for t in plan["proxied"] + [plan["allowed"]]}}))
"""


def probe_plan(shared: Shared, nodes: list[Node]) -> dict[str, Any]:
    """What a sandbox on a node tries: the host's broker, S3 and registry (and the broker's loopback port on the
    host's address; the registry on the host's other addresses), every node's Saucer, the internet — directly, and
    the inward ones through the proxy too."""
    host = shared.address
    inward = [(host, int(b.rpartition(":")[2])) for b in shared.bootstrap_nodes.split(",")]
    inward += [(host, shared.kafka_port), (host, shared.s3_port), (host, shared.registry_port)]
    inward += [(n.address, SAUCER_PORT) for n in nodes]
    # The host's other addresses, where the registry listens too (on every address).
    addresses = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    inward += [(a, shared.registry_port) for a in re.findall(r"inet ([0-9.]+)/", addresses)
               if a != host and not a.startswith("127.")]
    return {"direct": inward + list(OUTSIDE), "proxied": [f"{h}:{p}" for h, p in inward] + ["example.com:443"],
            "allowed": ALLOWED, "proxy": [EGRESS_GATEWAY, EGRESS_PORT]}


def escapes(outcome: dict[str, Any], allowed: str) -> tuple[int, bool]:
    """(attempts that got through, the allowed registry answered through the proxy) of one probe's outcome."""
    through = sum(bool(v) for v in outcome.get("direct", {}).values())
    proxied = outcome.get("proxied", {})
    through += sum(code == "200" for target, code in proxied.items() if target != allowed)
    return through, proxied.get(allowed) == "200"


def egress_probe(node: Node, image: str, plan: dict[str, Any]) -> dict[str, Any]:
    """The probe in a build step's sandbox on the node's egress network (the sandbox policy's ``BUILD_STEP``)."""
    engine = node.engine()
    container = sandbox.create(engine, image, ["python3", "-c", PROBE, json.dumps(plan)], profile=sandbox.BUILD_STEP,
                               limits=sandbox.Limits(), egress="kiln-egress", start=True)
    try:
        container.wait(timeout=120)
        outcome: dict[str, Any] = json.loads(container.logs(stdout=True, stderr=False).decode().strip() or "{}")
        return outcome
    finally:
        container.remove(force=True)


@dataclass
class Tracked:
    """Requests whose answers are checked: each one's outcome and when it came (monotonic), by name."""

    answers: dict[str, bool] = field(default_factory=dict)
    at: dict[str, float] = field(default_factory=dict)

    async def run(self, name: str, request: Awaitable[bool]) -> None:
        self.answers[name] = False
        try:
            self.answers[name] = await request
        except KilnError as e:
            console.print(f"{name}: {e}")
        self.at[name] = time.monotonic()

    def lost(self) -> int:
        return sum(not ok for ok in self.answers.values())

    def after(self, moment: float, names: list[str]) -> int:
        """Of ``names``, those answered rightly after ``moment``."""
        return sum(self.answers.get(n, False) and self.at.get(n, 0.0) > moment for n in names)


async def built_here_ran_there(kiln: KilnClient, client: ExecClient, store: SaucerStore, nodes: list[Node],
                               partitions: int, work: Path, out: dict[str, float]) -> None:
    """A layered build of a small make project on whichever node's builder takes it; then its image (a registry
    reference by digest) run by exec ``run_once`` calls until every other node has run it."""
    name = f"nodes/calc-{uuid.uuid4().hex[:8]}"
    make_project(work / "make")
    await ingest_into(store, name, work / "make", work / "ingest-make")
    event: BuildEvent = await BuilderClient(kiln).build(BuildRequest(repository=name, layered=True),
                                                        result_timeout_s=1200)
    assert event.usable and event.image, event
    built_on = [n for n in nodes if await asyncio.to_thread(n.holds, event.image)]
    others = [n for n in nodes if n not in built_on]
    console.print(f"{name} built on node {[n.index for n in built_on]} as {event.image}")
    right = True
    for _ in range(10):
        answers = await asyncio.gather(*(client.run_once(event.image, "./test_calc", timeout_s=120)
                                         for _ in range(2 * partitions)))
        right = right and all(a.output is not None and "Tests passed: 1" in a.output.stdout for a in answers)
        if all(await asyncio.gather(*(asyncio.to_thread(n.holds, event.image) for n in others))):
            break
    ran = sum(await asyncio.gather(*(asyncio.to_thread(n.holds, event.image) for n in others)))
    out["nodes_built_here_ran_there"] = ran if right and len(built_on) == 1 else 0
    toolchain = nodes[0].shared.bases["toolchain"]
    out["nodes_bases_by_digest"] = sum(await asyncio.gather(*(asyncio.to_thread(n.holds, toolchain) for n in nodes)))


def slow_make_project(path: Path, seconds: float, run: str) -> None:
    """The make project whose link step sleeps ``seconds`` first (a build step seen in flight); ``run`` makes its
    sources this run's own, so no node's build cache holds the step."""
    builder = make_project(path)
    write(path, "Makefile", f"test_calc: calc.o test_calc.o\n\tsleep {seconds:g}\n"
                            "\t$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS)\n\ntest: test_calc\n\t./test_calc\n\n.PHONY: test\n")
    write(path, "run.txt", f"{run}\n")
    builder.commit("a slow link")


async def scenario(args: argparse.Namespace, shared: Shared, nodes: list[Node]) -> dict[str, float]:
    settings = shared.host_settings()
    partitions = args.partitions
    admin.create_topics(settings, [*(TopicSpec(t, partitions) for t in TOPICS.values()),
                                   *(TopicSpec(f"{t}.dlq", 1) for t in TOPICS.values()),
                                   TopicSpec(EVENTS_TOPIC, 1), TopicSpec(RESULTS_TOPIC, 2)])
    image = await asyncio.to_thread(seed_images, shared)
    console.print(f"sandbox image: {image}; bases: {shared.bases}")
    for n in nodes:
        await asyncio.to_thread(n.clean)
    slots = {"exec": args.slots, "build": args.build_slots, "lean": args.lean_slots}
    for n in nodes:
        n.start_workers(settings, slots)
    for n in nodes:
        await asyncio.to_thread(n.wait_assigned, 120)
    await until(lambda: settled(nodes, partitions), "every node owning partitions of every stage", 120)
    out: dict[str, float] = {}
    kiln = KilnClient(settings, f"nodes-{uuid.uuid4().hex[:6]}", results_topic=RESULTS_TOPIC)
    work = Path(tempfile.mkdtemp(prefix="kiln-nodes-"))
    store = SaucerStore(open_blob_store(settings), work / "saucer-cache")
    reading = asyncio.Event()
    reader = await saucer_on_every_node(store, nodes, work)
    reads = asyncio.create_task(reader.run(reading))
    tracked = Tracked()
    client = ExecClient(kiln, sessions_per_key=args.sessions_per_key)
    lean = LeanClient(kiln)
    building = asyncio.create_task(built_here_ran_there(kiln, client, store, nodes, partitions, work, out))
    try:
        # 1. First use on every node: each pulls the image by digest from the registry. Calls go to random
        # partitions: rounds of them until every node has served one (or ten rounds).
        for _ in range(10):
            answers = await asyncio.gather(*(client.run_once(image, "python3 -c 'print(6*7)'", timeout_s=60)
                                             for _ in range(2 * partitions)))
            assert all(a.output and a.output.stdout.strip() == "42" for a in answers), answers
            if all(await asyncio.gather(*(asyncio.to_thread(n.holds, image) for n in nodes))):
                break
        out["nodes_pulled_by_digest"] = sum(await asyncio.gather(*(asyncio.to_thread(n.holds, image) for n in nodes)))
        # 2. Each node's egress, from a build step's sandbox and from an exec sandbox.
        plan = probe_plan(shared, nodes)
        outcomes = await asyncio.gather(*(asyncio.to_thread(egress_probe, n, image, plan) for n in nodes))
        plan = {**plan, "proxied": []}  # an exec sandbox: no network, no proxy either
        exec_probe = await client.run_once(image, f"python3 probe.py {shlex.quote(json.dumps(plan))}",
                                           files={"probe.py": PROBE}, timeout_s=120)
        outcomes.append(json.loads(exec_probe.output.stdout if exec_probe.output else "{}"))
        verdicts = [escapes(o, ALLOWED) for o in outcomes]
        console.print(f"egress probes: {outcomes}")
        # A probe that reported nothing counts as an escape: the check fails closed.
        out["nodes_egress_escapes"] = sum(v[0] for v in verdicts) + sum(not o.get("direct") for o in outcomes)
        out["nodes_egress_proxy_allowed"] = sum(v[1] for v in verdicts[: len(nodes)])
        # Lean on every node: theorems checked, each node's partitions in turn.
        for n in nodes:
            for key in keys_on(n, "lean", partitions, f"lean-{n.index}", 2):
                await tracked.run(key, _lean_ok(lean.run_code(THEOREMS, key=key)))
        out["nodes_lean_answered"] = sum(tracked.answers.values())
        # 4. Sessions of one repository gather on one node, then spill to another.
        repository = spill_repository(nodes, partitions)
        sessions: list[ExecSession] = []
        for _ in range(args.sessions_per_key + 1):
            sessions.append(await client.open_session(image, repository=repository))
        hosts = [(await client.run(s, "hostname")).stdout.strip() for s in sessions]
        placed = [where(nodes, h) for h in hosts]
        console.print(f"sessions of {repository}: nodes {placed}")
        gathered = placed[: args.sessions_per_key]
        out["nodes_affinity_ok"] = float(len(set(gathered)) == 1 and gathered[0] != 0)
        out["nodes_spilled_to_other_node"] = float(placed[-1] not in (0, gathered[0]))
        await building
        victim = next(n for n in nodes if n.index == gathered[0])
        survivors = [n for n in nodes if n is not victim]
        # 5. (--kill-build) a build in flight on the victim, then Lean requests on its partitions and calls
        # everywhere; then it dies whole.
        pending: list[asyncio.Task[None]] = []
        builds: list[str] = []
        if args.kill_build:
            marker = f"sleep {args.build_s:g}"
            run = uuid.uuid4().hex[:8]
            slow = keys_on(victim, "build", partitions, f"nodes/slow-{run}", 1)[0]
            slow_make_project(work / "slow", args.build_s, run)
            await ingest_into(store, slow, work / "slow", work / "ingest-slow")
            builds.append(slow)
            pending.append(asyncio.create_task(tracked.run(slow, _build_ok(BuilderClient(kiln).build(
                BuildRequest(repository=slow), result_timeout_s=1800)))))
            await until(lambda: running(victim, marker), f"node {victim.index} holding an in-flight build", 600)
        lean_keys = keys_on(victim, "lean", partitions, "sleeper", args.lean_requests)
        for key in lean_keys:
            code = f"-- fake: sleep {args.lean_s:g}\n{THEOREMS}"
            pending.append(asyncio.create_task(tracked.run(key, _lean_ok(lean.run_code(code, key=key,
                                                                                        timeout_s=args.lean_s + 120)))))
        calls = [f"answer-{i}-{uuid.uuid4().hex[:6]}" for i in range(args.calls)]
        pending += [asyncio.create_task(tracked.run(token, _answers(client.run_once(
            image, f"sleep {args.call_s}; echo {token}", timeout_s=120), token))) for token in calls]
        await until(lambda: running(victim, "sleep", "exec-session"), f"node {victim.index} holding an in-flight call",
                    60)
        lean_in_flight = [k for k in lean_keys if k not in tracked.at]
        console.print(f"node {victim.index} holds in-flight calls, {len(lean_in_flight)} Lean requests, "
                      f"{len(builds)} builds and {len(gathered)} sessions: killing it whole")
        killed_at = time.monotonic()
        await asyncio.to_thread(victim.kill)
        await until(lambda: settled(survivors, partitions), "the survivors owning every partition", 180, 0.1)
        out["nodes_takeover_s"] = round(time.monotonic() - killed_at, 2)
        lost_answered = hung = 0
        for s, host in zip(sessions, hosts, strict=True):
            if where(survivors, host):
                continue  # a session on a surviving node lives on
            try:
                await asyncio.wait_for(client.run(s, "true"), 120)
            except RequestFailed as e:
                lost_answered += "SessionLost" in str(e)
            except TimeoutError:
                hung += 1
        out["nodes_sessions_lost_answered"] = lost_answered
        out["nodes_sessions_hung"] = hung
        await asyncio.wait_for(asyncio.gather(*pending), 1800)
        out["nodes_lost_requests"] = tracked.lost()
        out["nodes_lean_replayed"] = tracked.after(killed_at, lean_in_flight)
        if args.kill_build:
            out["nodes_builds_replayed"] = tracked.after(killed_at, builds)
        # 6. The node comes back: its new workers reap what the dead ones left.
        await asyncio.to_thread(victim.up)
        exec_left, build_left = await asyncio.to_thread(leaked, nodes)
        out["nodes_leftovers_on_return"] = exec_left + build_left
        out["nodes_build_leftovers_on_return"] = build_left
        victim.start_workers(settings, slots)
        await asyncio.to_thread(victim.wait_assigned, 120)
        with contextlib.suppress(RuntimeError):
            await until(lambda: sum(leaked(nodes)) == 0, "the dead workers' containers reaped", args.settle, 0.5)
        out["nodes_leaked_containers"] = sum(await asyncio.to_thread(leaked, nodes))
    finally:
        building.cancel()
        reading.set()
        await reads
        out["nodes_saucer_reads"], out["nodes_saucer_failed_reads"] = reader.reads, reader.failed
        await kiln.close()
        shutil.rmtree(work, ignore_errors=True)
    raw = await asyncio.to_thread(raw_results, settings, settings.topic(RESULTS_TOPIC))
    out["nodes_duplicate_answers"] = sum(c - 1 for c in raw.values() if c > 1)
    return out


async def _answers(call: Awaitable[Any], token: str) -> bool:
    result = await call
    return bool(result.output and result.output.stdout.strip() == token)


async def _lean_ok(call: Awaitable[Any]) -> bool:
    result = await call
    return bool(result.ok and len(result.sorries) == 3)


async def _build_ok(call: Awaitable[BuildEvent]) -> bool:
    event = await call
    return event.usable


async def run(args: argparse.Namespace) -> dict[str, float]:
    shared = Shared(args.kafka_port, args.brokers, args.s3_port, args.registry_port)
    await asyncio.to_thread(shared.start)
    nodes = [Node(i, shared) for i in range(1, args.nodes + 1)]
    try:
        # Side by side; every one finished (or failed) before anything is torn down.
        for outcome in await asyncio.gather(*(asyncio.to_thread(n.up) for n in nodes), return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        return await scenario(args, shared, nodes)
    finally:
        for n in nodes:
            WorkerProcess.stop_all(list(n.workers.values()), 20)
            n.stop_servers()
        for n in nodes:
            with contextlib.suppress(docker.errors.DockerException, requests.RequestException, KeyError):
                await asyncio.to_thread(n.forget_builds)
            with contextlib.suppress(RuntimeError):
                script(NODES_SH, "down", str(n.index))
        with contextlib.suppress(RuntimeError):
            script(NODES_SH, "down")  # the host's rules for the nodes' subnet
        with contextlib.suppress(KilnError):
            admin.delete_topics(shared.host_settings(), [*TOPICS.values(), *(f"{t}.dlq" for t in TOPICS.values()),
                                                         EVENTS_TOPIC, RESULTS_TOPIC])
        if not args.keep_broker:
            shared.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--brokers", type=int, default=1)
    p.add_argument("--calls", type=int, default=16, help="run_once calls in flight when the node is killed")
    p.add_argument("--call-s", type=float, default=6.0, help="how long each of those calls sleeps")
    p.add_argument("--lean-requests", type=int, default=4, help="Lean requests in flight on the victim")
    p.add_argument("--lean-s", type=float, default=20.0, help="how long each of them sleeps (the fake REPL's)")
    p.add_argument("--kill-build", action=argparse.BooleanOptionalAction, default=True,
                   help="a build in flight on the victim when it dies")
    p.add_argument("--build-s", type=float, default=45.5, help="how long that build's link step sleeps")
    p.add_argument("--sessions-per-key", type=int, default=2)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--build-slots", type=int, default=2)
    p.add_argument("--lean-slots", type=int, default=4)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--settle", type=float, default=30.0, help="seconds the reapers get after the node is back")
    p.add_argument("--kafka-port", type=int, default=39292)
    p.add_argument("--s3-port", type=int, default=39470)
    p.add_argument("--registry-port", type=int, default=39500)
    p.add_argument("--keep-broker", action="store_true", help="leave the broker running (a warm next run)")
    return p


def main() -> None:
    args = parser().parse_args()
    metrics = asyncio.run(run(args))
    report(f"nodes: {args.nodes} worker nodes, one lost whole", metrics,
           {"brokers": str(args.brokers), "calls in flight": str(args.calls), "build killed": str(args.kill_build)})


if __name__ == "__main__":
    main()
