"""Chaos storm: SIGKILLed workers, a broker restart, a client restarted with the same id, and poison of every class
mixed in; then count what was lost, delivered twice, re-run, and whether the stage ever halted.

It runs on a broker of its own (``--port``, default 19092, data under the kiln run directory), so the restart never
disturbs anything else. ``sleep`` workers journal every start and end; the client submits open loop and never
stops on errors; poison goes straight to the request topic (a deadline without a timezone, 5 MB of bytes, a
reply_to partition or topic that does not exist, garbage, an envelope without its payload; keys, headers and values
up to 1.2 MB in every combination; reply addresses librdkafka refuses (600 characters, a NUL byte); no reply address,
or the request topic as one; a payload only a coercion would accept; a claim check that decompresses past the bound).
Every ``--kill-every`` seconds one worker is SIGKILLed and replaced; at a sixth the results topic refuses every write
for ``--results-outage`` seconds (``min.insync.replicas`` above its replication factor: producers get
NOT_ENOUGH_REPLICAS and keep retrying); halfway the broker is stopped for 5 s; at two thirds the client closes and a
new process-local client with the same id takes over (what the old one had not received comes through
``unclaimed()``). A second client, its clock an hour behind, sends requests with 300 s deadlines to a results topic of
its own from just before the broker stops (the workers' first lookups of that topic meet no broker); a third, on a
results topic made after the broker restart, sees it deleted at five sixths (once its results are in), sends
requests while it is gone, and sees it created again.

Prints ``chaos_lost_results`` (good requests never answered, and their futures never failed either: what is lost
without a word, each explained), ``chaos_failed_requests`` (ones whose future failed with a typed error: the broker
away longer than the producer's ``message.timeout.ms``, or a client closed before the broker took them; their callers
were told), ``chaos_duplicate_deliveries`` (request ids
delivered more than once, across both client lives), ``chaos_reexecuted_per_kill`` (extra starts ÷ kills),
``chaos_reexecuted_finished`` (jobs started again after they had ended), ``chaos_stage_halts`` (workers that exited
without being killed), ``chaos_skewed_expired`` (the skewed client's requests answered 'expired'), and the counts
behind them. The storm's broker is stopped when it ends.
Usage: python -m bench.chaos [--seconds 300] [--kill-every 5] [--workers 3] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import zstandard
from confluent_kafka import Producer
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from bench.common import console, report
from kiln.schemas.builtin import SleepRequest
from kiln.schemas.envelope import RequestEnvelope, ResultEnvelope, new_request_id
from kiln.streams import admin, codec
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.client import KilnClient
from kiln.streams.errors import InfraError, KilnError
from kiln.streams.processes import WorkerProcess
from kiln.streams.replay import read_topic
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import BROKER_TIME, TopicSpec

KAFKA = Path(__file__).resolve().parents[1] / "infra" / "kafka" / "kafka.sh"


def broker(port: int, action: str) -> None:
    subprocess.run(["bash", str(KAFKA), action], env={**os.environ, "KILN_KAFKA_PORT": str(port)}, check=True,
                   stdout=subprocess.DEVNULL)


def _min_insync(settings: KilnSettings, topic: str, replicas: int, patience_s: float = 90.0) -> None:
    """With more in-sync replicas required than the topic has, every acks=all write to it fails (retriably).
    Retried while the broker is away (the outage may overlap the broker restart)."""
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("min.insync.replicas", str(replicas), incremental_operation=AlterConfigOpType.SET)])
    deadline = time.monotonic() + patience_s
    while True:
        client = admin.admin_client(settings)  # kept alive until its futures are done
        try:
            for future in client.incremental_alter_configs([resource]).values():
                future.result(30)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


Poison = tuple[bytes, bytes | None, list[tuple[str, bytes]] | None]
"""A record's value, key and headers."""
BIG = 1_200_000


def poison(request: str, results: str, store: FileBlobStore) -> list[Poison]:
    """One record of each poison class."""
    def envelope(**changes: object) -> bytes:
        body = json.loads(RequestEnvelope(kind="sleep", client_id="mallory", payload={}).model_dump_json())
        body["reply_to"] = {"topic": results, "key": "mallory", "partition": 0}
        body.update(changes)
        return json.dumps(body).encode()

    no_payload = json.loads(envelope().decode())
    del no_payload["payload"]
    no_reply = json.loads(envelope().decode())
    del no_reply["reply_to"]
    bomb = store.put(zstandard.ZstdCompressor().compress(b"\0" * (codec.CLAIM_CHECK_MAX_BYTES + (1 << 20))))
    claim_bomb = {**no_payload, "claim_check": {"digest": bomb.digest, "size": bomb.size}}
    values = [envelope(deadline="2030-01-01T00:00:00"), b"x" * 5_000_000,
              envelope(reply_to={"topic": results, "key": "m", "partition": 999}),
              envelope(reply_to={"topic": "no-such-topic", "key": "m"}), b"\x00garbage",
              json.dumps(no_payload).encode(), envelope(reply_to={"topic": "r" * 600, "key": "m"}),
              envelope(reply_to={"topic": "bad\x00topic", "key": "m"}), json.dumps(no_reply).encode(),
              envelope(reply_to={"topic": request, "key": "m", "partition": 0}), envelope(payload={"seconds": True}),
              json.dumps(claim_bomb).encode()]
    oversized: list[Poison] = [
        (b"\x00garbage", b"k" * BIG, None),  # a malformed value with a 1.2 MB key
        (b"\x00garbage", b"m", [("big", b"h" * BIG)]),  # one 1.2 MB header
        (b"v" * 899_000, b"m", [("h", b"h" * 200_000)]),  # an 899 KB malformed value, a 200 KB header
        (envelope(payload={"not_a_field": 1}), b"k" * BIG, None),  # a payload the model refuses, a 1.2 MB key
        (b"x" * 5_000_000, b"k" * BIG, [("big", b"h" * BIG)]),  # everything large at once
    ]
    return [(value, None, None) for value in values] + oversized


class Storm:
    def __init__(self, settings: KilnSettings, args: argparse.Namespace, request: str, results: str,
                 journal: Path) -> None:
        self.settings, self.args, self.request, self.results, self.journal = settings, args, request, results, journal
        self.workers: list[WorkerProcess] = []
        self.killed = 0
        self.halts = 0
        self.sent: set[str] = set()
        self.delivered: Counter[str] = Counter()
        self.skewed_expired = 0
        self.skewed_sent: set[str] = set()
        self.origin: dict[str, str] = {}  # request id -> which client sent it
        self.submitted_at: dict[str, float] = {}  # request id -> when (monotonic)
        self.moments: dict[str, float] = {}  # what happened when (monotonic): the broker's stop, a topic's deletion
        self.failed: dict[str, str] = {}  # request id -> why its future failed
        self.poisoned = 0
        self.submitted_all = False
        self.settled = asyncio.Event()  # every request submitted and delivered

    def spawn(self) -> None:
        self.workers.append(WorkerProcess("sleep", self.settings, self.request, slots=self.args.slots,
                                          journal=self.journal, grace_s=5))

    async def supervise(self, kill_until: float, stop: asyncio.Event) -> None:
        """Replace workers that exit by themselves (counted as halts) until ``stop``; SIGKILL one every
        ``--kill-every`` seconds until ``kill_until``."""
        rng = random.Random(1)
        next_kill = time.monotonic() + self.args.kill_every
        while not stop.is_set():
            await asyncio.sleep(0.2)
            for w in list(self.workers):
                if w.proc.poll() is not None:  # exited without being killed: the stage halted here
                    self.halts += 1
                    console.print(f"[red]worker exited by itself ({w.proc.returncode}):[/] {w.log}")
                    self.replace(w)
            if time.monotonic() >= next_kill and time.monotonic() < kill_until and self.workers:
                victim = self.victim(rng)
                victim.kill()
                self.killed += 1
                self.replace(victim)
                next_kill += self.args.kill_every

    def victim(self, rng: random.Random) -> WorkerProcess:
        """The worker the next kill takes (one of ``workers``, which is not empty)."""
        return rng.choice(self.workers)

    def replace(self, worker: WorkerProcess) -> None:
        """A new worker in the place of ``worker``, which was killed or exited."""
        self.workers.remove(worker)
        self.spawn()

    def track(self, fut: asyncio.Future[ResultEnvelope], request_id: str, label: str) -> None:
        """Count a request just sent by client ``label``: its result is recorded the moment its future resolves (so
        one resolved while the client closes is counted too)."""
        self.sent.add(request_id)
        self.origin[request_id] = label
        self.submitted_at[request_id] = time.monotonic()
        fut.add_done_callback(lambda f: self.record_future(f, request_id))

    async def submit(self, client: KilnClient, until: float | asyncio.Event, rng: random.Random,
                     rate: float | None = None, poison_share: float | None = None, deadline_s: float | None = None,
                     label: str = "main") -> None:
        """Submit open loop until ``until`` (a time, or an event set); each result is recorded the moment its future
        resolves (so one resolved while the client closes is counted too)."""
        producer = Producer({"bootstrap.servers": self.settings.bootstrap_servers, "compression.type": "zstd",
                             "message.max.bytes": 10_000_000})
        share = self.args.poison_share if poison_share is None else poison_share
        bad = poison(self.request, self.results, FileBlobStore(self.settings.cache / "blobs")) if share else []
        while not until.is_set() if isinstance(until, asyncio.Event) else time.monotonic() < until:
            request_id = new_request_id()
            try:
                fut = await client.submit("sleep", SleepRequest(seconds=rng.uniform(0.02, 0.3)), topic=self.request,
                                          request_id=request_id, deadline_s=deadline_s)
            except KilnError:
                await asyncio.sleep(0.1)
                continue
            self.track(fut, request_id, label)
            if deadline_s is not None:  # only the skewed client sends deadlines
                self.skewed_sent.add(request_id)
            if rng.random() < share:
                value, key, headers = bad[self.poisoned % len(bad)]
                producer.produce(self.request, value, key=key, headers=headers)
                self.poisoned += 1
            producer.poll(0)
            await asyncio.sleep(1 / (rate or self.args.rate))
        producer.flush(30)

    def unanswered(self, results_topics: list[str], journal: Path) -> tuple[set[str], set[str]]:
        """(failed, lost): the requests whose future failed with a typed error, printed by client and error, and
        those with neither an answer nor an error, each explained (``explain_lost``)."""
        failed = set(self.failed) - set(self.delivered)
        if failed:
            causes = Counter((self.origin[rid], self.failed[rid].split(":")[0]) for rid in failed)
            console.print(f"[yellow]failed, their callers told, {len(failed)}[/] by client and error: {dict(causes)}")
        lost = self.sent - set(self.delivered) - failed
        if lost:
            self.explain_lost(lost, results_topics, journal)
        return failed, lost

    def explain_lost(self, lost: set[str], results_topics: list[str], journal: Path) -> None:
        """Print what is known of each lost request (no answer, no error): its client, when it was sent (against
        the storm's moments), how often it ran, and whether its result is on its results topic (sent, never
        delivered) or not (never sent, or sent to a topic since deleted)."""
        console.print(f"[red]lost {len(lost)}[/] by client: {dict(Counter(self.origin[rid] for rid in lost))}")
        on_topics: Counter[str] = Counter()
        for topic in results_topics:
            with contextlib.suppress(KilnError):
                for msg in read_topic(self.settings, topic):
                    on_topics[codec.result_request_id(msg.value() or b"", msg.headers()) or ""] += 1
        runs = Counter(line.split()[1] for line in journal.read_text().splitlines() if line.startswith("end "))
        for rid in sorted(lost):
            sent = self.submitted_at[rid]
            moments = ", ".join(f"{what} {at - sent:+.2f} s" for what, at in sorted(self.moments.items(),
                                                                                     key=lambda m: m[1]))
            console.print(f"  {rid} ({self.origin[rid]}): ran to its end {runs[rid]}x, {on_topics[rid]} result(s) "
                          f"on the results topics now; after it was sent: {moments}")

    def record(self, envelope: ResultEnvelope) -> None:
        self.delivered[envelope.request_id] += 1
        self.skewed_expired += envelope.status == "expired"  # only the skewed client sends deadlines
        self.check_settled()

    def record_future(self, fut: asyncio.Future[ResultEnvelope], request_id: str) -> None:
        if fut.cancelled():
            return
        error = fut.exception()
        if error is None:
            self.record(fut.result())
        elif isinstance(error, KilnError):
            self.failed[request_id] = f"{type(error).__name__}: {error}"
            self.check_settled()

    def check_settled(self) -> None:
        """Once everything is submitted: settled when every request was answered or failed."""
        if self.submitted_all and len(self.delivered.keys() | self.failed.keys()) >= len(self.sent):
            self.settled.set()

    async def side_client(self, results: str, start: float | asyncio.Event, end: float, restarted: asyncio.Event, *,
                          skewed: bool, recreate_at: float | None = None) -> None:
        """A second client on a results topic of its own, from ``start`` (a time, or an event) to ``end``, then
        waiting up to ``--settle`` seconds for its answers from the broker's return (``restarted``: a broker that
        takes minutes to load its logs on a loaded machine must not close the client before its results come).
        ``skewed``: its clock an hour behind, 300 s deadlines. ``recreate_at``: then, once its results are in, the topic
        is deleted (created first if it is not there yet), requests are sent while it is gone, and it is created
        again: they must all arrive."""
        if isinstance(start, asyncio.Event):
            await start.wait()
            await asyncio.to_thread(admin.create_topics, self.settings, [TopicSpec(results, 4, BROKER_TIME)])
        else:
            await asyncio.sleep(max(0.0, start - time.monotonic()))
        rng = random.Random(11)
        client = KilnClient(self.settings, f"chaos-side-{uuid.uuid4().hex[:6]}", results_topic=results,
                            max_in_flight=100_000, clock=(lambda: time.time() - 3600) if skewed else time.time)
        rate = max(1.0, self.args.rate / 4)
        # Shorter than the skew, so a deadline compared across the two clocks would expire every request; longer than
        # the storm's real delays (the group takes up to a minute to recover from the broker restart).
        deadline_s = 300.0 if skewed else None
        label = "skewed" if skewed else "recreated"
        try:
            if recreate_at is not None:
                recreate_at = max(recreate_at, time.monotonic() + 2)  # some results before the topic goes
                await self.submit(client, recreate_at, rng, rate=rate, poison_share=0, deadline_s=deadline_s,
                                  label=label)
                # Every result in before the topic goes: one still on it when it is deleted goes with it (a results
                # topic deleted loses what it held; the client says so when it sees the topic again).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(client.settled(), self.args.settle)
                await asyncio.to_thread(delete_until_gone, self.settings, results)
                self.moments["recreated topic deleted"] = time.monotonic()
                console.print(f"results topic {results}: deleted")
                await self.submit(client, time.monotonic() + 1, rng, rate=rate, poison_share=0, deadline_s=deadline_s,
                                  label=label)
                await asyncio.to_thread(create_again, self.settings, TopicSpec(results, 4, BROKER_TIME))
                self.moments["recreated topic created again"] = time.monotonic()
                console.print(f"results topic {results}: created again")
            await self.submit(client, end, rng, rate=rate, poison_share=0, deadline_s=deadline_s, label=label)
            await restarted.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.settled(), self.args.settle)
        finally:
            await client.close()


def delete_until_gone(settings: KilnSettings, topic: str, patience_s: float = 60.0) -> None:
    """Delete a topic and wait until the broker no longer has it. The controller acknowledges a deletion before the
    broker applies it, and until then the broker still takes writes to the topic, which go with it (on this 2-core
    machine under load, 3 of 40 writes acknowledged just after the deletion returned were lost so): a request sent
    "while the topic is gone" is one sent after this returns."""
    failed = admin.delete_topics(settings, [topic])
    if failed:
        raise InfraError(f"deleting {topic}: {failed}")
    client = admin.admin_client(settings)
    deadline = time.monotonic() + patience_s
    while (md := client.list_topics(topic, timeout=10).topics.get(topic)) is not None and md.error is None:
        if time.monotonic() > deadline:
            raise InfraError(f"topic {topic} still there {patience_s:g} s after its deletion")
        time.sleep(0.05)


def create_again(settings: KilnSettings, spec: TopicSpec, patience_s: float = 60.0) -> None:
    """Create a topic just deleted (the broker frees the name a moment later)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if admin.create_topics(settings, [spec]).get(spec.name) == "created":
                return
        except InfraError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


async def run(args: argparse.Namespace) -> dict[str, float]:
    """The storm on its own broker, which is stopped when it ends (also when it fails half-way)."""
    broker(args.port, "start")
    try:
        return await _storm(args)
    finally:
        broker(args.port, "stop")


async def _storm(args: argparse.Namespace) -> dict[str, float]:
    settings = KilnSettings(bootstrap_servers=f"127.0.0.1:{args.port}",
                            cache=Path(os.environ.get("KILN_CACHE", Path.home() / ".cache/kiln")) / "chaos")
    admin.wait_for_broker(settings)
    tag = uuid.uuid4().hex[:8]
    request, results = f"chaos-{tag}", f"chaos-{tag}-results"
    skewed_results, recreated_results = f"chaos-{tag}-skewed-results", f"chaos-{tag}-recreated-results"
    admin.create_topics(settings, [TopicSpec(request, 8, BROKER_TIME), TopicSpec(f"{request}.dlq", 1),
                                   TopicSpec(results, 4, BROKER_TIME), TopicSpec(skewed_results, 4, BROKER_TIME)])
    journal = settings.cache / f"journal-{tag}"
    journal.parent.mkdir(parents=True, exist_ok=True)
    storm = Storm(settings, args, request, results, journal)
    try:
        for _ in range(args.workers):
            storm.spawn()
        for w in storm.workers:
            w.wait_assigned(120)
        rng = random.Random(7)
        started = time.monotonic()
        end = started + args.seconds
        stop_supervising = asyncio.Event()
        supervisor = asyncio.create_task(storm.supervise(end, stop_supervising))

        restarted = asyncio.Event()

        async def restart_broker() -> None:
            await asyncio.sleep(args.seconds / 2)
            console.print("broker: stop")
            storm.moments["broker stopping"] = time.monotonic()
            await asyncio.to_thread(broker, args.port, "stop")
            await asyncio.sleep(5)
            await asyncio.to_thread(broker, args.port, "start")
            storm.moments["broker started again"] = time.monotonic()
            console.print("broker: started again")
            restarted.set()

        async def results_outage() -> None:
            # Over well before the broker restart: a broker stopped while a topic demands more in-sync replicas than it
            # has leaves that topic's partitions without an eligible leader (KRaft's ELR), i.e. offline for good.
            await asyncio.sleep(args.seconds / 6)
            console.print(f"results topic: unavailable for {args.results_outage:g} s")
            await asyncio.to_thread(_min_insync, settings, results, 2)
            await asyncio.sleep(args.results_outage)
            await asyncio.to_thread(_min_insync, settings, results, 1)
            console.print("results topic: available again")

        restart = asyncio.create_task(restart_broker())
        outage = asyncio.create_task(results_outage())
        # The skewed client's topic is first used just before the broker stops; the re-created one is made after
        # the restart: librdkafka's producer ignores a re-created topic's partitions when the broker restarted since
        # it cached the old ones (their leader epochs start again at 0: confluentinc/librdkafka#4898).
        sides = [asyncio.create_task(storm.side_client(skewed_results, started + args.seconds / 2 - 1, end, restarted,
                                                       skewed=True)),
                 asyncio.create_task(storm.side_client(recreated_results, restarted, end, restarted, skewed=False,
                                                       recreate_at=started + args.seconds * 5 / 6))]
        client_id = f"chaos-trainer-{tag}"
        first = KilnClient(settings, client_id, results_topic=results, max_in_flight=100_000)
        await storm.submit(first, started + args.seconds * 2 / 3, rng)
        await asyncio.sleep(2)
        await first.close()  # a planned restart: what it had not received goes to the next life

        second = KilnClient(settings, client_id, results_topic=results, max_in_flight=100_000)

        async def drain_unclaimed() -> None:
            async for envelope in second.unclaimed():
                if envelope.client_id == client_id:
                    storm.record(envelope)

        drainer = asyncio.create_task(drain_unclaimed())
        await storm.submit(second, end, rng)
        storm.submitted_all = True
        await restart
        await outage
        for side in sides:
            await side
        storm.check_settled()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(storm.settled.wait(), args.settle)
        await asyncio.sleep(5)  # late duplicates of what was delivered last would still arrive now
        drainer.cancel()
        stop_supervising.set()
        await supervisor
        await second.close()
    finally:
        # Graceful stops, also when the storm fails half-way: no worker outlives it (no await here, so the
        # supervisor cannot respawn one meanwhile; asyncio.run cancels it afterwards).
        for w in storm.workers:
            w.stop(10)
    # A request whose future failed with a typed error was not lost: its caller was told (the broker away past the
    # producer's message.timeout.ms, 120 s, or the client closed before the broker took it) and may send it again.
    failed, lost = storm.unanswered([results, skewed_results, recreated_results], journal)
    admin.delete_topics(settings, [request, f"{request}.dlq", results, skewed_results, recreated_results])
    starts: Counter[str] = Counter()
    reruns_after_end = 0
    ended: set[str] = set()
    for line in journal.read_text().splitlines():
        event, rid = line.split()[:2]
        if event == "start":
            starts[rid] += 1
            reruns_after_end += rid in ended
        else:
            ended.add(rid)
    extra_starts = sum(starts.values()) - len(starts)
    return {
        "chaos_lost_results": float(len(lost)),
        "chaos_failed_requests": float(len(failed)),
        "chaos_duplicate_deliveries": float(sum(1 for n in storm.delivered.values() if n > 1)),
        "chaos_reexecuted_per_kill": round(extra_starts / max(1, storm.killed), 3),
        "chaos_reexecuted_finished": float(reruns_after_end),
        "chaos_stage_halts": float(storm.halts),
        "chaos_skewed_expired": float(storm.skewed_expired),
        "chaos_requests": float(len(storm.sent)),
        "chaos_kills": float(storm.killed),
        "chaos_poison_messages": float(storm.poisoned),
        "chaos_extra_starts": float(extra_starts),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--kill-every", type=float, default=5)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rate", type=float, default=20, help="good requests per second")
    parser.add_argument("--poison-share", type=float, default=0.02)
    parser.add_argument("--settle", type=float, default=120, help="seconds to wait for the last results")
    parser.add_argument("--port", type=int, default=19092)
    parser.add_argument("--results-outage", type=float, default=30,
                        help="seconds the results topic refuses writes (ends before the broker restart halfway)")
    args = parser.parse_args()
    report("chaos storm", asyncio.run(run(args)))


if __name__ == "__main__":
    main()
