"""Several worker nodes on one machine, one of them lost whole mid-run (issue 46, item 3).

A node (``infra/nodes/nodes.sh``) is a network namespace with its own Docker engine (own containerd, data root,
bridge) and its own kiln exec worker. The nodes share only what a real cluster's nodes share, over the nodes' bridge
(never loopback): a Kafka broker or cluster started here with a listener on the bridge, an S3 server (the claim-check
store) and the registry on it. The scenario:

1. **Images only through the registry**: the sandbox image is pushed once to the registry; every node's engine
   starts without it and pulls it by digest on first use (``nodes_pulled_by_digest``: nodes whose engine then holds
   it under that digest).
2. **Affinity and spill-over**: ``--sessions-per-key`` sessions of one repository gather on one node (one partition
   key); the next one spills to the next key, chosen so that it is owned by another node (``nodes_affinity_ok``,
   ``nodes_spilled_to_other_node``).
3. **A node lost whole**: ``run_once`` calls (``sleep`` then an answer) are in flight on every node; once the victim
   node holds at least one confirmed in-flight call (a ``sleep`` seen in one of its sandboxes) and sessions, it is
   killed whole — workers, dockerd, containerd, shims and sandboxes frozen and SIGKILLed together. Its calls replay
   on the others and complete (``nodes_lost_requests``: calls never answered or answered wrongly;
   ``nodes_duplicate_answers``: result records beyond the first of one request on the results topic, read raw,
   before any client deduplicates); its sessions
   answer ``SessionLost`` (``nodes_sessions_lost_answered``, never a hang: ``nodes_sessions_hung``);
   ``nodes_takeover_s``: from the kill until the survivors own every partition of the exec topic.
4. **The node comes back**: its engine restarts with what the dead worker left (``nodes_leftovers_on_return``); the
   new worker's reaper removes it (``nodes_leaked_containers``: containers on any node's engine whose worker is dead,
   after ``--settle`` s).
5. **Saucer on every node**, off the shared store (S3): a client reads a file of an ingested repository all along,
   from the nodes in turn, trying the next node when one does not answer (as a Service in front of them would);
   ``nodes_saucer_reads`` and ``nodes_saucer_failed_reads`` (reads no node answered; aim 0) across the node's loss.

Usage: python -m bench.nodes [--nodes 2] [--calls 16] [--sessions-per-key 2] [--brokers 1] [--call-s 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import docker
import httpx
from confluent_kafka import Consumer

from bench.common import console, report, until
from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
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
from kiln.workers.exec.client import ExecClient, ExecSession
from tests.workers.builder.projects import python_project

REPO = Path(__file__).resolve().parents[1]
NODES_SH = REPO / "infra" / "nodes" / "nodes.sh"
EXEC_TOPIC = "exec.requests"
RESULTS_TOPIC = "nodes.results"
IMAGE_REPOSITORY = "kiln/nodes-sandbox"
SAUCER_PORT = 8700
SAUCER_REPOSITORY = "nodes/calc"


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

    def kafka_env(self) -> dict[str, str]:
        return {"KILN_KAFKA_PORT": str(self.kafka_port), "KILN_KAFKA_BROKERS": str(self.brokers),
                "KILN_KAFKA_NODES_ADDRESS": self.address}

    def s3_env(self) -> dict[str, str]:
        return {"KILN_S3_ADDRESS": self.address, "KILN_S3_PORT": str(self.s3_port)}

    def registry_env(self) -> dict[str, str]:
        # The registry listens on every address of the host: the nodes pull over the bridge, the host's engine
        # pushes the seed image over loopback (an engine trusts a plain-HTTP registry only on loopback or when
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
        return {"KILN_BOOTSTRAP_SERVERS": self.bootstrap_nodes, "KILN_BLOB_STORE": "s3://kiln-nodes/claims",
                "KILN_S3_ENDPOINT": self.secrets["KILN_S3_ENDPOINT"],
                "KILN_S3_ACCESS_KEY": self.secrets["KILN_S3_ACCESS_KEY"],
                "KILN_S3_SECRET_KEY": self.secrets["KILN_S3_SECRET_KEY"],
                "KILN_EXEC_REGISTRY": self.registry,
                "KILN_EXEC_REGISTRY_USER": self.secrets["KILN_BUILD_REGISTRY_USER"],
                "KILN_EXEC_REGISTRY_PASSWORD": self.secrets["KILN_BUILD_REGISTRY_PASSWORD"],
                "KILN_EXEC_IMAGE_PREFIXES": json.dumps([f"{self.registry}/kiln/"]),
                "KILN_EXEC_REAP_INTERVAL_S": "2", "KILN_EXEC_WARM": "0"}


class Node:
    def __init__(self, index: int, shared: Shared) -> None:
        self.index = index
        self.shared = shared
        self.workers: list[WorkerProcess] = []
        self.servers: list[subprocess.Popen[bytes]] = []
        self.env = dict(line.partition("=")[::2] for line in script(NODES_SH, "env", str(index)).splitlines())

    def up(self) -> None:
        script(NODES_SH, "up", str(self.index), env={"KILN_NODES_INSECURE_REGISTRY": self.shared.registry})

    def kill(self) -> None:
        script(NODES_SH, "kill", str(self.index))
        for proc in [w.proc for w in self.workers] + self.servers:
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
             "serve", "--host", self.env["KILN_NODE_ADDRESS"], "--port", str(SAUCER_PORT)],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT))
        return f"http://{self.env['KILN_NODE_ADDRESS']}:{SAUCER_PORT}"

    def stop_servers(self) -> None:
        for proc in self.servers:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            proc.kill()
        self.servers.clear()

    def engine(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.env["DOCKER_HOST"], timeout=60)

    def start_exec_worker(self, settings: KilnSettings, slots: int) -> WorkerProcess:
        worker = WorkerProcess("exec", settings, settings.topic(EXEC_TOPIC), slots=slots, grace_s=10,
                               env=self.shared.node_env(), group="nodes-exec",
                               launcher=["bash", str(NODES_SH), "run", str(self.index)])
        self.workers.append(worker)
        return worker

    def owned(self) -> set[int]:
        """The exec partitions this node's live workers hold, from their logs: an assignment adds partitions, a
        revocation or a loss takes them away (incremental, as the group hands them over)."""
        owned: set[int] = set()
        for w in self.workers:
            if w.proc.poll() is not None:
                continue
            held: set[int] = set()
            for change, listed in re.findall(r"\b(assigned|revoked|lost) \[([0-9, ]*)\]", w.log.read_text()):
                partitions = {int(p) for p in listed.split(",") if p.strip()}
                held = held | partitions if change == "assigned" else held - partitions
            owned |= held
        return owned

    def clean(self) -> None:
        """Start from an empty engine: no container, and no copy of the sandbox image (so it must be pulled)."""
        engine = self.engine()
        for c in engine.containers.list(all=True):
            with contextlib.suppress(docker.errors.APIError):
                c.remove(force=True)
        for image in engine.images.list():
            if any(IMAGE_REPOSITORY in ref for ref in image.attrs.get("RepoDigests", []) + image.tags):
                engine.images.remove(image.id, force=True)


def seed_image(shared: Shared) -> str:
    """kiln's base image pushed to the registry (over loopback, from the host's engine); its reference by digest
    as the nodes see it."""
    run_steps(COMPONENT_STEPS["docker"])
    host = docker.from_env(timeout=600)
    base = host.images.get("kiln/base:latest")
    tag = base.id.split(":")[1][:12]
    local = f"127.0.0.1:{shared.registry_port}/{IMAGE_REPOSITORY}"
    base.tag(local, tag)
    auth = {"username": shared.secrets["KILN_BUILD_REGISTRY_USER"],
            "password": shared.secrets["KILN_BUILD_REGISTRY_PASSWORD"]}
    for line in host.images.push(local, tag, auth_config=auth, stream=True, decode=True):
        if "error" in line:
            raise RuntimeError(f"push failed: {line['error']}")
    digest = host.images.get_registry_data(f"{local}:{tag}", auth_config=auth).id
    return f"{shared.registry}/{IMAGE_REPOSITORY}@{digest}"


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


async def saucer_on_every_node(settings: KilnSettings, nodes: list[Node], work: Path) -> SaucerReader:
    """A repository ingested into the shared store, Saucer served from every node, a reader started."""
    store = SaucerStore(open_blob_store(settings), work / "saucer-cache")
    python_project(work / "src")
    event = await ingest(IngestRequest(name=SAUCER_REPOSITORY, location=str(work / "src")), "nodes", store,
                         work / "ingest")
    assert event.status == "ingested", event
    token = uuid.uuid4().hex
    urls = [n.serve_saucer(token) for n in nodes]
    expected = (work / "src" / "calc" / "__init__.py").read_bytes()

    def serving() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return all(httpx.get(f"{u}/healthz", timeout=2).status_code == 200 for u in urls)
        return False

    await until(serving, "Saucer answering on every node", 60)
    return SaucerReader(urls, token, expected)


def settled(nodes: list[Node], partitions: int) -> bool:
    """Every partition owned by exactly one node, and every node owning some."""
    owned = [n.owned() for n in nodes]
    return all(owned) and sum(map(len, owned)) == partitions and set().union(*owned) == set(range(partitions))


def partition_of(key: str, partitions: int) -> int:
    """librdkafka's default partitioner (consistent_random: CRC32 of the key)."""
    return zlib.crc32(key.encode()) % partitions


def spill_repository(nodes: list[Node], partitions: int, per_key: int) -> str:
    """A repository name whose first key and spill-over key are owned by different nodes."""
    owner = {p: n.index for n in nodes for p in n.owned()}
    for i in range(10_000):
        name = f"repo-{i}"
        first, spill = partition_of(f"{name}#0", partitions), partition_of(f"{name}#1", partitions)
        if owner.get(first) and owner.get(spill) and owner[first] != owner[spill]:
            return name
    raise RuntimeError(f"no repository spills to another node: ownership {owner}")


def where(nodes: list[Node], container: str) -> int:
    """The node whose engine runs ``container`` (a session's hostname: its container's short id); 0 for none."""
    for n in nodes:
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError, docker.errors.DockerException):
            if n.engine().containers.get(container).status == "running":
                return n.index
    return 0


def busy(node: Node) -> bool:
    """A sandbox of the node runs a call's ``sleep`` (a confirmed in-flight call)."""
    with contextlib.suppress(docker.errors.APIError, docker.errors.DockerException):
        for c in node.engine().containers.list(filters={"label": "kiln.role=exec-session"}):
            top = c.top()
            if any("sleep" in " ".join(p) for p in top.get("Processes") or []):
                return True
    return False


def lock_dead(path: str) -> bool:
    """The worker holding ``path`` is gone (the lock can be taken)."""
    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True
    except FileNotFoundError:
        return True


def leaked(nodes: list[Node]) -> int:
    return sum(lock_dead(c.labels.get("kiln.lock", "")) for n in nodes
               for c in n.engine().containers.list(all=True, filters={"label": "kiln.role=exec-session"}))


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


async def scenario(args: argparse.Namespace, shared: Shared, nodes: list[Node]) -> dict[str, float]:
    settings = shared.host_settings()
    partitions = args.partitions
    admin.create_topics(settings, [TopicSpec(EXEC_TOPIC, partitions), TopicSpec(f"{EXEC_TOPIC}.dlq", 1),
                                   TopicSpec(RESULTS_TOPIC, 2)])
    image = await asyncio.to_thread(seed_image, shared)
    console.print(f"sandbox image: {image}")
    for n in nodes:
        await asyncio.to_thread(n.clean)
    for n in nodes:
        n.start_exec_worker(settings, args.slots)
    for n in nodes:
        await asyncio.to_thread(n.workers[0].wait_assigned, 120)
    await until(lambda: settled(nodes, partitions), "every node owning exec partitions", 120)
    out: dict[str, float] = {}
    kiln = KilnClient(settings, f"nodes-{uuid.uuid4().hex[:6]}", results_topic=RESULTS_TOPIC)
    work = Path(tempfile.mkdtemp(prefix="kiln-nodes-"))
    reading = asyncio.Event()
    reader = await saucer_on_every_node(settings, nodes, work)
    reads = asyncio.create_task(reader.run(reading))
    try:
        client = ExecClient(kiln, sessions_per_key=args.sessions_per_key)
        # 1. First use on every node: each pulls the image by digest from the registry. Calls go to random
        # partitions: rounds of them until every node has served one (or ten rounds).
        digest = image.split("@", 1)[1]

        def pulled(n: Node) -> bool:
            return any(d.endswith(digest) for i in n.engine().images.list() for d in i.attrs.get("RepoDigests", []))

        for _ in range(10):
            answers = await asyncio.gather(*(client.run_once(image, "python3 -c 'print(6*7)'", timeout_s=60)
                                             for _ in range(2 * partitions)))
            assert all(a.output and a.output.stdout.strip() == "42" for a in answers), answers
            if all(await asyncio.gather(*(asyncio.to_thread(pulled, n) for n in nodes))):
                break
        out["nodes_pulled_by_digest"] = sum(await asyncio.gather(*(asyncio.to_thread(pulled, n) for n in nodes)))
        # 2. Sessions of one repository gather on one node, then spill to another.
        repository = spill_repository(nodes, partitions, args.sessions_per_key)
        sessions: list[ExecSession] = []
        for _ in range(args.sessions_per_key + 1):
            sessions.append(await client.open_session(image, repository=repository))
        hosts = [(await client.run(s, "hostname")).stdout.strip() for s in sessions]
        placed = [where(nodes, h) for h in hosts]
        console.print(f"sessions of {repository}: nodes {placed}")
        gathered = placed[: args.sessions_per_key]
        out["nodes_affinity_ok"] = float(len(set(gathered)) == 1 and gathered[0] != 0)
        out["nodes_spilled_to_other_node"] = float(placed[-1] not in (0, gathered[0]))
        victim = next(n for n in nodes if n.index == gathered[0])
        survivors = [n for n in nodes if n is not victim]
        # 3. Calls in flight everywhere, then the node holding the sessions is lost whole.
        expected: dict[str, str] = {}

        async def call(i: int) -> None:
            token = f"answer-{i}-{uuid.uuid4().hex[:6]}"
            expected[token] = ""
            try:
                result = await client.run_once(image, f"sleep {args.call_s}; echo {token}", timeout_s=120)
                expected[token] = result.output.stdout.strip() if result.output else ""
            except KilnError as e:
                expected[token] = f"error: {e}"

        calls = [asyncio.create_task(call(i)) for i in range(args.calls)]
        await until(lambda: busy(victim), f"node {victim.index} holding an in-flight call", 60)
        console.print(f"node {victim.index} holds in-flight calls and {len(gathered)} sessions: killing it whole")
        killed_at = time.monotonic()
        await asyncio.to_thread(victim.kill)
        await until(lambda: settled(survivors, partitions), "the survivors owning every exec partition", 180, 0.1)
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
        await asyncio.wait_for(asyncio.gather(*calls), 300)
        out["nodes_lost_requests"] = sum(answer != token for token, answer in expected.items())
        # 4. The node comes back: its new worker reaps what the dead one left.
        await asyncio.to_thread(victim.up)
        out["nodes_leftovers_on_return"] = await asyncio.to_thread(leaked, nodes)
        victim.start_exec_worker(settings, args.slots)
        await asyncio.to_thread(victim.workers[0].wait_assigned, 120)
        with contextlib.suppress(RuntimeError):
            await until(lambda: leaked(nodes) == 0, "the dead worker's containers reaped", args.settle, 0.5)
        out["nodes_leaked_containers"] = await asyncio.to_thread(leaked, nodes)
    finally:
        reading.set()
        await reads
        out["nodes_saucer_reads"], out["nodes_saucer_failed_reads"] = reader.reads, reader.failed
        await kiln.close()
        shutil.rmtree(work, ignore_errors=True)
    raw = await asyncio.to_thread(raw_results, settings, settings.topic(RESULTS_TOPIC))
    out["nodes_duplicate_answers"] = sum(c - 1 for c in raw.values() if c > 1)
    return out


async def run(args: argparse.Namespace) -> dict[str, float]:
    shared = Shared(args.kafka_port, args.brokers, args.s3_port, args.registry_port)
    await asyncio.to_thread(shared.start)
    nodes = [Node(i, shared) for i in range(1, args.nodes + 1)]
    for n in nodes:
        await asyncio.to_thread(n.up)
    try:
        return await scenario(args, shared, nodes)
    finally:
        for n in nodes:
            WorkerProcess.stop_all(n.workers, 20)
            n.stop_servers()
        for n in nodes:
            with contextlib.suppress(RuntimeError):
                script(NODES_SH, "down", str(n.index))
        with contextlib.suppress(RuntimeError):
            admin.delete_topics(shared.host_settings(), [EXEC_TOPIC, f"{EXEC_TOPIC}.dlq", RESULTS_TOPIC])
        if not args.keep_broker:
            shared.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--brokers", type=int, default=1)
    p.add_argument("--calls", type=int, default=16, help="run_once calls in flight when the node is killed")
    p.add_argument("--call-s", type=float, default=6.0, help="how long each of those calls sleeps")
    p.add_argument("--sessions-per-key", type=int, default=2)
    p.add_argument("--slots", type=int, default=4)
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
           {"brokers": str(args.brokers), "calls in flight": str(args.calls)})


if __name__ == "__main__":
    main()
