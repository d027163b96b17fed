"""Broker faults, measured (issue 46): kiln's storm on a replicated three-node KRaft cluster of its own.

The cluster (``infra/kafka/kafka.sh`` with ``KILN_KAFKA_BROKERS=3`` on ``--port``: replication 3,
``min.insync.replicas`` 2, unclean election off) serves sleep jobs from two clients (``bench.chaos``'s storm: its
sleep workers SIGKILLed and replaced every ``--worker-kill-every`` seconds), exec ``run_once`` calls and exec
sessions from a third and verify batches (checked by the exec stage) from a fourth, while its brokers fail, in
this order:

1. ``--broker-kills`` times, every ``--broker-kill-every`` seconds (once the cluster is whole again): SIGKILL of a
   node — alternately the one leading the most of the storm's partitions and the group coordinator of one of its
   consumer groups — and its restart ``--down-s`` seconds later;
2. a rolling restart of every node (SIGTERM: a controlled shutdown, then the start), one at a time;
3. the node leading the most partitions paused (SIGSTOP) for the broker session timeout plus ``--pause-extra-s``,
   then resumed;
4. one node SIGKILLed for good: the cluster serves on two for the rest of the run (at least ``--tail-s``).

An exec worker is SIGKILLed (among the sleep workers' kills) every ``--exec-kill-every`` seconds: its sessions answer
``SessionLost`` (a new one is opened), its calls run again elsewhere. The load runs for at least ``--seconds``.

METRIC lines: ``cluster_lost_results`` (requests never answered, their futures never failed: lost without a word),
``cluster_failed_requests`` (futures failed with a typed error: their callers were told),
``cluster_duplicate_deliveries`` (request ids the clients delivered more than once),
``cluster_duplicate_results_raw`` (request ids with more than one result on the results topic, before any client
deduplicates: a job run again after a kill answers again) and ``cluster_duplicate_results_one_run`` (of those, ids
with two results of one run — the same worker and start: a producer's retry written twice, aim 0),
``cluster_stage_halts`` (workers that exited without being killed), ``cluster_reexecuted_per_kill`` (sleep jobs'
extra starts ÷ sleep workers killed), ``cluster_stall_s_p50`` / ``_max``: after each broker SIGKILL (the cluster
whole before it, so two or more brokers alive after it), the longest stretch until the next fault (or the end)
in which no client received a result of any request; ``cluster_stall_bound_s``: what the printed settings allow
it, summed. (With replication 3 on three nodes every partition has a replica on the dead node, and an ``acks=all``
write — a request, a result, an offset commit — waits for every replica in sync until the controller fences the node,
``broker.session.timeout.ms`` after its last heartbeat, and elects leaders elsewhere. When the dead node was the
active controller, the others notice after ``controller.quorum.fetch.timeout.ms``, elect one within twice
``controller.quorum.election.timeout.ms`` (Raft's randomised timeout) — or, when both survivors stood at once and
split the vote (they notice together: one fetch timeout), after that round's timeout, a backoff of up to
``controller.quorum.election.backoff.max.ms`` and a second round — and the new controller counts every broker's
session from its own start (measured here: leaders moved 8.0-14.5 s after a kill). The clients then find the
new leaders at their next metadata request, within librdkafka's ``retry.backoff.max.ms``. The bound is that worst
case: session + fetch timeout + twice the election timeout + the election backoff + the clients' backoff.) With
them: the same stretch
for the worse
of the two sleep clients (``cluster_sleep_client_stall_s_max``) and in the sleep workers' own journal (jobs ending:
``cluster_worker_stall_s_max``); the stretches after the rolling restart's stops and after the pause; how long a dead
node still led partitions (``cluster_leaders_moved_s_max``); wrong answers (aim 0); sessions lost to exec worker
kills; and the settings that decide the stall (``SETTING`` lines: the brokers', and what kiln's workers and clients
run with).

Usage: python -m bench.cluster [--broker-kills 8] [--broker-kill-every 22] [--seconds 300] [--port 39092]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType
from pydantic import BaseModel

from bench.chaos import KAFKA, Storm
from bench.common import console, percentile, report
from bench.verify import IMAGE
from bench.verify import batch as addition_batch
from kiln.schemas.envelope import ResultEnvelope, new_request_id
from kiln.streams import admin, codec
from kiln.streams.client import KilnClient
from kiln.streams.console import log_file, route_kafka_logs
from kiln.streams.errors import InfraError, KilnError, RequestFailed
from kiln.streams.processes import WorkerProcess
from kiln.streams.replay import read_topic
from kiln.streams.settings import KilnSettings, producer_config
from kiln.streams.stage import topology
from kiln.workers.exec.client import ExecClient, ExecSession
from kiln.workers.verifiers import exact_match
from kiln.workers.verify.client import VerifyClient

RESULTS = "kiln.results"
STAGE_TOPICS = {"sleep": "sleep.requests", "exec": "exec.requests", "verify": "verify.requests"}
BROKER_SETTINGS = ("broker.session.timeout.ms", "broker.heartbeat.interval.ms", "controller.quorum.fetch.timeout.ms",
                   "controller.quorum.election.timeout.ms", "controller.quorum.election.backoff.max.ms",
                   "replica.lag.time.max.ms",
                   "group.consumer.session.timeout.ms", "group.consumer.heartbeat.interval.ms",
                   "default.replication.factor", "min.insync.replicas", "unclean.leader.election.enable")
KAFKA_DEFAULTS = {"broker.session.timeout.ms": "9000", "controller.quorum.fetch.timeout.ms": "2000",
                  "controller.quorum.election.timeout.ms": "1000", "controller.quorum.election.backoff.max.ms": "1000"}
"""Apache Kafka's defaults, for a broker that does not report its own."""
LIBRDKAFKA_DEFAULTS: dict[str, Any] = {
    "socket.timeout.ms": 60000, "socket.connection.setup.timeout.ms": 30000, "request.timeout.ms": 30000,
    "metadata.max.age.ms": 900000, "topic.metadata.refresh.interval.ms": 300000, "retry.backoff.ms": 100,
    "retry.backoff.max.ms": 1000, "reconnect.backoff.max.ms": 10000}
"""librdkafka's defaults for the client settings that decide how fast a client finds a partition's new leader."""


class Ports:
    """Metrics ports for the storm's workers, from a fixed range (each a port nothing listens on when taken)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.next = first, last, first

    def take(self) -> int:
        for _ in range(self.last - self.first + 1):
            port, self.next = self.next, self.next + 1 if self.next < self.last else self.first
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
        raise InfraError(f"no free port in {self.first}-{self.last}")


class Cluster:
    """The storm's own cluster, driven through kafka.sh (``KILN_KAFKA_PORT``, ``KILN_KAFKA_BROKERS``; its data under
    ``KILN_KAFKA_DATA`` where set)."""

    def __init__(self, port: int, brokers: int) -> None:
        self.env = {**os.environ, "KILN_KAFKA_PORT": str(port), "KILN_KAFKA_BROKERS": str(brokers)}
        self.nodes = list(range(1, brokers + 1))

    def sh(self, *args: str) -> str:
        return subprocess.run(["bash", str(KAFKA), *args], env=self.env, check=True, stdout=subprocess.PIPE,
                              text=True, timeout=900).stdout

    def start_node(self, node: int, attempts: int = 5) -> None:
        """Start a node again. Its port may be taken for a while: it lies in Linux's ephemeral range here
        (32768-60999), so while the node is down any outgoing connection can be handed it as its local port — a client
        reconnecting to the node on loopback even connects to itself (held until librdkafka's connection setup times
        out) — and the node cannot bind it. Such a self-connect is closed first, and the start tried again."""
        port = int(self.env["KILN_KAFKA_PORT"]) + 10 * (node - 1)
        for attempt in range(1, attempts + 1):
            for taken in (port, port + 1, port + 2):  # a self-connect there closed (iproute2's ss, as root)
                subprocess.run(["ss", "-K", "-tn", "src", f"127.0.0.1:{taken}", "dst", f"127.0.0.1:{taken}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            try:
                self.sh("start-node", str(node))
                return
            except subprocess.CalledProcessError:
                if attempt == attempts:
                    raise
                console.print(f"[yellow]node {node} did not start (attempt {attempt}); again in 2 s")
                time.sleep(2)

    def pid(self, node: int) -> int:
        pids = self.sh("pids").split()
        return dict(zip(map(int, pids[0::2]), map(int, pids[1::2]), strict=True))[node]


@dataclass
class Fault:
    kind: str  # kill | lost (killed for good) | restart (rolling) | pause
    node: int
    at: float  # monotonic
    why: str
    leaders_moved_s: float | None = None  # until no partition of the storm's topics had this node as its leader


class Faults:
    """The broker faults, in order, and what the cluster showed of each."""

    def __init__(self, cluster: Cluster, settings: KilnSettings, topics: set[str], groups: list[str],
                 args: argparse.Namespace, session_timeout_s: float) -> None:
        self.cluster, self.topics, self.groups, self.args = cluster, topics, groups, args
        self.session_timeout_s = session_timeout_s
        self.admin = AdminClient(settings.kafka())
        self.log: list[Fault] = []
        self.watchers: list[asyncio.Task[None]] = []

    def _metadata(self) -> Any:
        """The cluster's metadata, asked again when the broker asked does not answer (it may be the one paused)."""
        failures = 0
        while True:
            try:
                return self.admin.list_topics(timeout=10)
            except Exception as e:
                failures += 1
                if failures == 5:
                    raise InfraError(f"no metadata from the cluster: {e}") from e

    def _partitions(self) -> tuple[int, list[Any]]:
        md = self._metadata()
        parts = [p for name, t in md.topics.items() if name in self.topics or name.startswith("__")
                 for p in t.partitions.values()]
        return len(md.brokers), parts

    def leaders(self) -> Counter[int]:
        md = self._metadata()
        return Counter(p.leader for name in self.topics if name in md.topics
                       for p in md.topics[name].partitions.values())

    def most_leaders(self) -> tuple[int, str]:
        (node, led), *_ = self.leaders().most_common(1)
        return node, f"leads {led} of the storm's partitions"

    def coordinator(self, group: str) -> int:
        """The node coordinating ``group``."""
        failures = 0
        while True:  # asked again when the broker asked does not answer (it may be the one paused)
            try:
                return admin.group_coordinator(self.admin, group)
            except Exception as e:
                failures += 1
                if failures == 5:
                    raise InfraError(f"no metadata from the cluster: {e}") from e

    def whole(self) -> bool:
        brokers, parts = self._partitions()
        return brokers == len(self.cluster.nodes) and all(p.leader >= 0 and len(p.isrs) == len(p.replicas)
                                                          for p in parts)

    async def until_whole(self) -> None:
        """Until every broker is back and every partition's replicas are all in sync again."""
        deadline = time.monotonic() + self.args.whole_patience_s
        while not await asyncio.to_thread(self.whole):
            if time.monotonic() > deadline:
                raise InfraError(f"the cluster was not whole {self.args.whole_patience_s:g} s after the last fault")
            await asyncio.sleep(0.5)

    def _watch(self, fault: Fault) -> None:
        """(A thread.) When the node stopped leading any of the storm's partitions (leaders elected elsewhere)."""
        deadline = fault.at + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if not self.leaders().get(fault.node):
                    fault.leaders_moved_s = time.monotonic() - fault.at
                    return
            time.sleep(0.1)

    def _fault(self, kind: str, node: int, why: str) -> Fault:
        fault = Fault(kind, node, time.monotonic(), why)
        self.log.append(fault)
        self.watchers.append(asyncio.create_task(asyncio.to_thread(self._watch, fault)))
        console.print(f"[bold]broker fault[/] {kind} node {node} ({why})")
        return fault

    async def run(self, started: float) -> None:
        args, nodes = self.args, self.cluster.nodes
        for i in range(args.broker_kills):
            await self.until_whole()
            await asyncio.sleep(max(0.0, started + args.warmup_s + i * args.broker_kill_every - time.monotonic()))
            if i % 2:
                group = self.groups[(i // 2) % len(self.groups)]
                node, why = await asyncio.to_thread(self.coordinator, group), f"coordinator of group {group}"
            else:
                node, why = await asyncio.to_thread(self.most_leaders)
            await self._signal("kill", node, why, signal.SIGKILL)
            await asyncio.sleep(args.down_s)
            await asyncio.to_thread(self.cluster.start_node, node)
        for node in nodes if args.rolling_restart else []:
            await self.until_whole()
            self._fault("restart", node, "rolling restart")
            await asyncio.to_thread(self.cluster.sh, "stop-node", str(node))
            await asyncio.to_thread(self.cluster.start_node, node)
        await self.until_whole()
        if args.pause:
            node, why = await asyncio.to_thread(self.most_leaders)
            pid = await self._signal("pause", node, f"{why}; SIGSTOP for "
                                     f"{self.session_timeout_s + args.pause_extra_s:g} s", signal.SIGSTOP)
            try:
                await asyncio.sleep(self.session_timeout_s + args.pause_extra_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            await self.until_whole()
        if not args.lose_one:
            return
        node, why = await asyncio.to_thread(self.most_leaders)
        await self._signal("lost", node, f"{why}; never restarted", signal.SIGKILL)

    async def _signal(self, kind: str, node: int, why: str, sig: signal.Signals) -> int:
        """Send ``sig`` to ``node`` as a fault; its pid."""
        pid = await asyncio.to_thread(self.cluster.pid, node)
        self._fault(kind, node, why)
        os.kill(pid, sig)
        return pid


class ClusterStorm(Storm):
    """``bench.chaos``'s storm with exec and verify workers beside its sleep workers; every request any of its
    clients sends is counted (``CountedClient``), and every first delivery is timed."""

    def __init__(self, settings: KilnSettings, args: argparse.Namespace, journal: Path, ports: Ports,
                 lock_dir: Path) -> None:
        super().__init__(settings, args, STAGE_TOPICS["sleep"], RESULTS, journal)
        self.ports, self.lock_dir = ports, lock_dir
        self.stage_of: dict[WorkerProcess, str] = {}
        self.kills: Counter[str] = Counter()
        self.next_exec_kill = float("inf")
        self.deliveries: list[tuple[float, str]] = []  # (monotonic, client) of each request's first delivery
        self.wrong: list[str] = []
        self.errors: Counter[str] = Counter()  # answered with an error, by kind and type
        self.error_reasons: dict[str, str] = {}  # the first reason of each kind and type
        self.sessions_opened = self.sessions_lost = self.verify_batches = self.unjudged = 0

    def spawn(self, stage: str = "sleep") -> None:
        env = {"KILN_TOPIC_PREFIX": self.settings.topic_prefix, "KILN_METRICS_PORT": str(self.ports.take())}
        if stage == "exec":
            env.update({"KILN_EXEC_LOCK_DIR": str(self.lock_dir), "KILN_EXEC_WARM": "1"})
        slots = {"sleep": self.args.slots, "exec": self.args.exec_slots, "verify": 16}[stage]
        worker = WorkerProcess(stage, self.settings, STAGE_TOPICS[stage], slots=slots, grace_s=5, env=env,
                               group=group_of(self.settings, stage),
                               journal=self.journal if stage == "sleep" else None)
        self.workers.append(worker)
        self.stage_of[worker] = stage

    def replace(self, worker: WorkerProcess) -> None:
        self.workers.remove(worker)
        self.spawn(self.stage_of.pop(worker))

    def victim(self, rng: random.Random) -> WorkerProcess:
        """A sleep worker, or an exec worker once ``--exec-kill-every`` seconds have passed since the last."""
        execs = [w for w in self.workers if self.stage_of[w] == "exec"]
        if execs and time.monotonic() >= self.next_exec_kill:
            self.next_exec_kill = time.monotonic() + self.args.exec_kill_every
            worker = rng.choice(execs)
        else:
            worker = rng.choice([w for w in self.workers if self.stage_of[w] == "sleep"])
        self.kills[self.stage_of[worker]] += 1
        return worker

    def record(self, envelope: ResultEnvelope) -> None:
        if envelope.request_id not in self.delivered:
            self.deliveries.append((time.monotonic(), self.origin.get(envelope.request_id, "?")))
        super().record(envelope)

    # ---- the load ----------------------------------------------------------------------------------------

    async def sleep_load(self, client: KilnClient, label: str, stop: asyncio.Event, seed: int) -> None:
        rng = random.Random(seed)
        await self.submit(client, stop, rng, rate=self.args.rate, poison_share=0, label=label)

    async def run_once_load(self, client: KilnClient, stop: asyncio.Event) -> None:
        execs, n = ExecClient(client), 0
        tasks: set[asyncio.Task[None]] = set()

        async def one(n: int) -> None:
            try:
                result = await execs.run_once(IMAGE, f"echo once-{n}", timeout_s=30)
            except KilnError as e:
                self.error(f"run_once {getattr(e, 'error_type', '') or type(e).__name__}", e)
                return
            if result.output is None or result.output.stdout.strip() != f"once-{n}":
                self.wrong.append(f"run_once {n}: {result.output}")

        while not stop.is_set():
            n += 1
            task = asyncio.create_task(one(n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(1 / self.args.exec_rate)
        if tasks:
            await asyncio.wait(tasks)

    def error(self, kind: str, e: Exception) -> None:
        self.errors[kind] += 1
        self.error_reasons.setdefault(kind, str(e)[:400])

    async def session_load(self, client: ExecClient, index: int, stop: asyncio.Event) -> None:
        """One session at a time, ``--session-commands`` commands each, then closed and another opened; one lost
        (its worker killed) is replaced."""
        session: ExecSession | None = None
        used = n = 0
        while not stop.is_set():
            try:
                if session is None:
                    session = await client.open_session(IMAGE, repository=f"cluster/{index}")
                    self.sessions_opened += 1
                    used = 0
                n += 1
                output = await client.run(session, f"echo s{index}-{n}", timeout_s=30)
                if output.stdout.strip() != f"s{index}-{n}":
                    self.wrong.append(f"session {index} command {n}: {output}")
                used += 1
                if used >= self.args.session_commands:
                    await client.close_session(session)
                    session = None
            except RequestFailed as e:
                if e.error_type == "SessionLost":
                    self.sessions_lost += 1
                else:
                    self.error(f"session {e.error_type}", e)
                session = None
            except KilnError as e:
                self.error(f"session {type(e).__name__}", e)
                session = None
            await asyncio.sleep(self.args.session_pause_s)
        if session is not None:
            with contextlib.suppress(KilnError):
                await client.close_session(session)

    async def verify_load(self, client: VerifyClient, stop: asyncio.Event) -> None:
        seed = 0
        while not stop.is_set():
            seed += 1
            tasks, completions = addition_batch(self.args.verify_prompts, self.args.verify_samples, seed)
            verdicts = await client.verify_batch(tasks, completions)
            self.verify_batches += 1
            for i, (task, completion, verdict) in enumerate(zip(tasks, completions, verdicts, strict=True)):
                if verdict.failure:
                    self.unjudged += 1
                elif verdict.reward != exact_match(task, completion):
                    self.wrong.append(f"verify batch {seed} #{i}: {verdict}")


class CountedClient(KilnClient):
    """A client whose every request, whichever facade sends it (``ExecClient``, ``VerifyClient``), the storm counts
    as sent and records as answered."""

    def __init__(self, storm: Storm, label: str) -> None:
        super().__init__(storm.settings, f"cluster-{label}-{uuid.uuid4().hex[:6]}", results_topic=RESULTS,
                         max_in_flight=100_000)
        self.storm, self.label = storm, label

    async def submit(self, kind: str, payload: BaseModel | dict[str, Any],
                     **kwargs: Any) -> asyncio.Future[ResultEnvelope]:
        request_id = kwargs.pop("request_id", None) or new_request_id()
        fut = await super().submit(kind, payload, request_id=request_id, **kwargs)
        self.storm.track(fut, request_id, self.label)
        return fut


def group_of(settings: KilnSettings, stage: str) -> str:
    """The consumer group of the storm's workers of ``stage`` (their topic's name: one per run)."""
    return f"g-{settings.topic(STAGE_TOPICS[stage])}"


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest stretch of ``[start, end]`` with none of ``times`` in it."""
    points = [start, *sorted(t for t in times if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(points))


def broker_settings(settings: KilnSettings) -> dict[str, str]:
    """The settings of the stall on the cluster's first broker (Kafka's defaults where it reports none)."""
    client = admin.admin_client(settings)
    broker = ConfigResource(ResourceType.BROKER, str(min(client.list_topics(timeout=30).brokers)))
    configs = client.describe_configs([broker])[broker].result(30)
    return {name: configs[name].value if name in configs and configs[name].value is not None
            else f"{KAFKA_DEFAULTS.get(name, '?')} (default)" for name in BROKER_SETTINGS}


def client_settings(settings: KilnSettings) -> dict[str, str]:
    """What kiln's producers (workers' and clients') and worker consumers run with: kiln's own settings over the
    deployment's (``KILN_KAFKA_CONFIG``) over librdkafka's defaults."""
    effective = {**LIBRDKAFKA_DEFAULTS, **producer_config(settings), **admin.group_membership(settings)}
    effective.pop("logger", None)
    effective.pop("bootstrap.servers", None)
    return {name: str(value) for name, value in sorted(effective.items())}


def ms(value: str) -> float:
    return float(value.split()[0]) / 1000


def raw_duplicates(settings: KilnSettings, sent: set[str]) -> tuple[int, int]:
    """Request ids with more than one result on the results topic, and those with two of one run (worker and
    start alike)."""
    runs: defaultdict[str, list[tuple[str, str]]] = defaultdict(list)
    for msg in read_topic(settings, RESULTS):
        value = msg.value() or b""
        request_id = codec.result_request_id(value, msg.headers())
        if request_id in sent:
            result = codec.decode_result(value)
            runs[request_id].append((result.worker, str(result.started_at)))
    duplicated = [r for r in runs.values() if len(r) > 1]
    return len(duplicated), sum(1 for r in duplicated if len(set(r)) < len(r))


async def run(args: argparse.Namespace) -> dict[str, float]:
    """The storm on its own cluster, which is stopped when it ends (also when it fails half-way)."""
    cluster = Cluster(args.port, args.brokers)
    await asyncio.to_thread(cluster.sh, "start")
    try:
        return await _storm(args, cluster)
    finally:
        await asyncio.to_thread(cluster.sh, "stop")


async def _storm(args: argparse.Namespace, cluster: Cluster) -> dict[str, float]:
    tag = uuid.uuid4().hex[:8]
    settings = KilnSettings(bootstrap_servers=cluster.sh("bootstrap").strip(), topic_prefix=f"cluster-{tag}.",
                            cache=Path(os.environ.get("KILN_CACHE", Path.home() / ".cache/kiln")) / "cluster")
    route_kafka_logs(settings, verbose=False)  # the kills' connection errors, by the hundred: to the log file
    console.print(f"librdkafka's lines: {log_file(settings)}")
    if admin.wait_for_broker(settings) != args.brokers:
        raise InfraError(f"the cluster at {settings.bootstrap_servers} has not {args.brokers} brokers")
    wanted = {RESULTS, "kiln.heartbeats", *STAGE_TOPICS.values(), *(f"{t}.dlq" for t in STAGE_TOPICS.values())}
    specs = [s for s in topology() if s.name in wanted]
    admin.create_topics(settings, specs)
    topics = {settings.topic(s.name) for s in specs}
    brokers = broker_settings(settings)
    clients = client_settings(settings)
    for who, values in (("broker", brokers), ("client", clients)):
        for name, value in values.items():
            print(f"SETTING {who} {name} {value}", flush=True)
    session_timeout_s = ms(brokers["broker.session.timeout.ms"])
    bound_s = (session_timeout_s + ms(brokers["controller.quorum.fetch.timeout.ms"])
               + 2 * ms(brokers["controller.quorum.election.timeout.ms"])
               + ms(brokers["controller.quorum.election.backoff.max.ms"]) + ms(clients["retry.backoff.max.ms"]))
    journal = settings.cache / f"journal-{tag}"
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.touch()
    wall_offset = time.time() - time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kiln-cluster-") as tmp:
        storm = ClusterStorm(settings, args, journal, Ports(args.metrics_ports, args.metrics_ports + 499),
                             Path(tmp) / "locks")
        try:
            for stage, count in (("sleep", args.workers), ("exec", args.exec_workers),
                                 ("verify", 1 if args.exec_workers else 0)):
                for _ in range(count):
                    storm.spawn(stage)
            for w in storm.workers:
                await asyncio.to_thread(w.wait_assigned, 300)
            metrics = await _load(args, settings, storm, cluster, topics, session_timeout_s, bound_s, wall_offset)
        finally:
            WorkerProcess.stop_all(storm.workers, 60)
    # The cluster's data stays for its next start, which loads every log it holds: not the storm's.
    failed = await asyncio.to_thread(admin.delete_topics, settings, sorted(topics))
    if failed:
        console.print(f"[yellow]topics not deleted:[/] {failed}")
    return metrics


async def _load(args: argparse.Namespace, settings: KilnSettings, storm: ClusterStorm, cluster: Cluster,
                topics: set[str], session_timeout_s: float, bound_s: float, wall_offset: float) -> dict[str, float]:
    sleepers = [KilnClient(settings, f"cluster-sleep-{c}-{uuid.uuid4().hex[:6]}", results_topic=RESULTS,
                           max_in_flight=100_000) for c in "ab"]
    exec_kiln, verify_kiln = CountedClient(storm, "exec"), CountedClient(storm, "verify")
    execs = ExecClient(exec_kiln)
    supervisor: asyncio.Task[None] | None = None
    try:
        if args.exec_workers:  # the paths work before anything fails (and the sandbox image is there)
            await asyncio.wait_for(execs.run_once(IMAGE, "true"), 300)
            await asyncio.wait_for(VerifyClient(verify_kiln).verify_batch(*addition_batch(2, 2, 0)), 300)
        started = time.monotonic()
        storm.next_exec_kill = started + args.exec_kill_every
        stop_load, stop_supervising = asyncio.Event(), asyncio.Event()
        supervisor = asyncio.create_task(storm.supervise(float("inf"), stop_supervising))
        loads = [asyncio.create_task(storm.sleep_load(c, f"sleep-{name}", stop_load, seed))
                 for seed, (name, c) in enumerate(zip("ab", sleepers, strict=True))]
        if args.exec_workers:
            loads.append(asyncio.create_task(storm.run_once_load(exec_kiln, stop_load)))
            loads += [asyncio.create_task(storm.session_load(execs, i, stop_load)) for i in range(args.sessions)]
            loads.append(asyncio.create_task(storm.verify_load(VerifyClient(verify_kiln), stop_load)))
        # Whose coordinator goes: the workers' groups, and a client's (the group reading its results).
        groups = [group_of(settings, stage) for stage in STAGE_TOPICS] + [f"kiln-client.{sleepers[0].client_id}"]
        faults = Faults(cluster, settings, topics, groups, args, session_timeout_s)
        try:
            await faults.run(started)
            await asyncio.sleep(max(args.tail_s, started + args.seconds - time.monotonic()))
        finally:
            stop_load.set()
        load_end = time.monotonic()
        done, pending = await asyncio.wait(loads, timeout=args.settle)
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        # No more kills while the last results come in; a worker exiting by itself is still a halt (and replaced).
        stop_supervising.set()
        await supervisor
        stop_supervising = asyncio.Event()
        supervisor = asyncio.create_task(storm.supervise(0, stop_supervising))
        storm.submitted_all = True
        storm.check_settled()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(storm.settled.wait(), args.settle)
        await asyncio.sleep(5)  # late duplicates of what was delivered last would still arrive now
        stop_supervising.set()
        await supervisor
        for watcher in faults.watchers:
            await watcher
    finally:
        if supervisor is not None:
            supervisor.cancel()  # (done already, unless the storm failed half-way: then no worker is replaced)
        for client in (*sleepers, exec_kiln, verify_kiln):
            await client.close()
    return _figures(settings, storm, faults.log, started, load_end, bound_s, wall_offset)


def _figures(settings: KilnSettings, storm: ClusterStorm, faults: list[Fault], started: float, load_end: float,
             bound_s: float, wall_offset: float) -> dict[str, float]:
    failed, lost = storm.unanswered([RESULTS], storm.journal)
    raw, one_run = raw_duplicates(settings, storm.sent)
    starts: Counter[str] = Counter()
    ends: list[float] = []
    for line in storm.journal.read_text().splitlines():
        if len(line.split()) != 5:
            continue  # cut short by a SIGKILL
        event, rid, _worker, _attempt, wall = line.split()
        starts[rid] += event == "start"
        if event == "end":
            ends.append(float(wall) - wall_offset)
    extra_starts = sum(starts.values()) - len(starts)
    delivered_at = [t for t, _ in storm.deliveries]
    by_client: defaultdict[str, list[float]] = defaultdict(list)  # the open-loop sleep clients
    for t, client in storm.deliveries:
        if client.startswith("sleep-"):
            by_client[client].append(t)
    stalls: dict[str, list[float]] = defaultdict(list)
    for fault, after in zip(faults, [*faults[1:], None], strict=True):
        end = after.at if after is not None else load_end
        stall = longest_gap(delivered_at, fault.at, end)
        worst_client = max((longest_gap(times, fault.at, end) for times in by_client.values()), default=end - fault.at)
        worker_stall = longest_gap(ends, fault.at, end)
        group = "kill" if fault.kind in ("kill", "lost") else fault.kind
        stalls[group].append(stall)
        stalls[f"{group} client"].append(worst_client)
        stalls[f"{group} worker"].append(worker_stall)
        moved = f"{fault.leaders_moved_s:.1f} s" if fault.leaders_moved_s is not None else "never seen"
        wall = datetime.fromtimestamp(fault.at + wall_offset, UTC).strftime("%H:%M:%S.%f")[:-3]
        console.print(f"{fault.kind} node {fault.node} at +{fault.at - started:.1f} s ({wall} UTC; {fault.why}): "
                      f"leaders moved after {moved}; stall {stall:.2f} s (a sleep client's {worst_client:.2f} s, the "
                      f"sleep workers' {worker_stall:.2f} s)")
    for line in storm.wrong[:10]:
        console.print(f"[red]wrong answer:[/] {line}")
    if storm.errors:
        console.print(f"answered with an error: {dict(storm.errors)}")
        for kind, reason in storm.error_reasons.items():
            console.print(f"  first {kind}: {reason}", markup=False)
    kills = stalls["kill"]
    if kills:
        console.print(f"stall after a broker kill: max {max(kills):.2f} s, "
                      f"{'within' if max(kills) <= bound_s else '[red]over[/]'} the bound {bound_s:g} s (broker "
                      "session timeout + the controller's fetch timeout + twice its election timeout + its election "
                      "backoff + the clients' retry.backoff.max.ms)")
    moved_s = [f.leaders_moved_s for f in faults if f.kind in ("kill", "lost") and f.leaders_moved_s is not None]
    return {
        "cluster_lost_results": float(len(lost)),
        "cluster_failed_requests": float(len(failed)),
        "cluster_duplicate_deliveries": float(sum(1 for n in storm.delivered.values() if n > 1)),
        "cluster_duplicate_results_raw": float(raw),
        "cluster_duplicate_results_one_run": float(one_run),
        "cluster_stage_halts": float(storm.halts),
        "cluster_reexecuted_per_kill": round(extra_starts / max(1, storm.kills["sleep"]), 3),
        "cluster_stall_s_p50": round(percentile(kills, 0.5), 2),
        "cluster_stall_s_max": round(max(kills, default=float("nan")), 2),
        "cluster_stall_bound_s": round(bound_s, 2),
        "cluster_sleep_client_stall_s_max": round(max(stalls["kill client"], default=float("nan")), 2),
        "cluster_worker_stall_s_max": round(max(stalls["kill worker"], default=float("nan")), 2),
        "cluster_rolling_stall_s_max": round(max(stalls["restart"], default=float("nan")), 2),
        "cluster_pause_stall_s": round(max(stalls["pause"], default=float("nan")), 2),
        "cluster_pause_sleep_client_stall_s": round(max(stalls["pause client"], default=float("nan")), 2),
        "cluster_leaders_moved_s_max": round(max(moved_s, default=float("nan")), 2),
        "cluster_broker_kills": float(len(kills)),
        "cluster_wrong_answers": float(len(storm.wrong)),
        "cluster_error_answers": float(sum(storm.errors.values())),
        "cluster_verify_unjudged": float(storm.unjudged),
        "cluster_verify_batches": float(storm.verify_batches),
        "cluster_sessions_opened": float(storm.sessions_opened),
        "cluster_sessions_lost": float(storm.sessions_lost),
        "cluster_requests": float(len(storm.sent)),
        "cluster_worker_kills": float(storm.kills["sleep"]),
        "cluster_exec_worker_kills": float(storm.kills["exec"]),
        "cluster_sleep_extra_starts": float(extra_starts),
        "cluster_seconds": round(load_end - started, 1),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300, help="the load runs at least this long")
    parser.add_argument("--port", type=int, default=39092, help="the cluster's first node (then +10, +20)")
    parser.add_argument("--brokers", type=int, default=3)
    parser.add_argument("--metrics-ports", type=int, default=39500, help="the workers' metrics ports: 500 from here")
    parser.add_argument("--warmup-s", type=float, default=15, help="load before the first fault")
    parser.add_argument("--broker-kills", type=int, default=8)
    parser.add_argument("--broker-kill-every", type=float, default=22)
    parser.add_argument("--down-s", type=float, default=5, help="a killed node's time down before its restart")
    parser.add_argument("--rolling-restart", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--pause", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--lose-one", action=argparse.BooleanOptionalAction, default=True,
                        help="a node SIGKILLed for good at the end")
    parser.add_argument("--pause-extra-s", type=float, default=5, help="a pause's length past the session timeout")
    parser.add_argument("--tail-s", type=float, default=30, help="load on two brokers after one is lost for good")
    parser.add_argument("--whole-patience-s", type=float, default=240)
    parser.add_argument("--kill-every", "--worker-kill-every", dest="kill_every", type=float, default=10,
                        help="a worker SIGKILLed (and replaced) this often")
    parser.add_argument("--exec-kill-every", type=float, default=60, help="of those, an exec worker this often")
    parser.add_argument("--workers", type=int, default=3, help="sleep workers")
    parser.add_argument("--slots", type=int, default=4, help="a sleep worker's slots")
    parser.add_argument("--exec-workers", type=int, default=2, help="0: sleep jobs only (no exec, no verify)")
    parser.add_argument("--exec-slots", type=int, default=4)
    parser.add_argument("--rate", type=float, default=10, help="sleep requests per second, per sleep client")
    parser.add_argument("--exec-rate", type=float, default=2, help="run_once calls per second")
    parser.add_argument("--sessions", type=int, default=2, help="exec sessions in use at once")
    parser.add_argument("--session-commands", type=int, default=15, help="commands per session before its close")
    parser.add_argument("--session-pause-s", type=float, default=0.2)
    parser.add_argument("--verify-prompts", type=int, default=8)
    parser.add_argument("--verify-samples", type=int, default=4)
    parser.add_argument("--settle", type=float, default=180, help="seconds to wait for the last results")
    return parser.parse_args(argv)


def main() -> None:
    report("broker faults on a three-node cluster", asyncio.run(run(parse())))


if __name__ == "__main__":
    main()
