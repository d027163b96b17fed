"""The dispatch bench's baseline: a bare confluent-kafka echo loop with kiln's message sizes, acks and partitions.

``python -m bench.raw_echo serve REQUESTS RESULTS SERVERS [after-delivery]`` is the echo server (its own process,
as a kiln worker is): a consumer group member that answers every request record with a result-sized record. By
default it lets the client library commit in the background (auto-commit: a request can be committed before its
reply is delivered, so a crash loses it); ``after-delivery`` gives kiln's guarantee instead: a request's offset is
committed only once its reply is delivered and every request below it on its partition is too (commits coalesced
every few milliseconds, as kiln's). ``round_trips()`` is the client: one producer, one consumer thread, a bound on
records in flight, closed loop. Batching and linger are tuned for throughput (the baseline at its best).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict, deque
from functools import partial
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from kiln.schemas.builtin import EchoRequest, EchoResult
from kiln.schemas.envelope import ReplyTo, RequestEnvelope, ResultEnvelope
from kiln.streams.settings import KilnSettings

TUNED = {"enable.idempotence": True, "acks": "all", "compression.type": "zstd", "linger.ms": 5,
         "batch.num.messages": 10_000, "queue.buffering.max.messages": 1_000_000}


def sample_sizes(results: str) -> tuple[bytes, bytes]:
    """A request and a result record as kiln encodes them for the no-op echo job (the same bytes on the wire)."""
    request = RequestEnvelope(kind="echo", client_id="bench", reply_to=ReplyTo(topic=results, key="bench", partition=0),
                              payload=EchoRequest(data=None).model_dump(mode="json"))
    result = ResultEnvelope(request_id=request.request_id, kind="echo", client_id="bench", status="ok",
                            result=EchoResult(data=None).model_dump(mode="json"), worker="bench-worker")
    return request.model_dump_json().encode(), result.model_dump_json().encode()


def serve(settings: KilnSettings, requests: str, results: str, after_delivery: bool) -> None:
    _, reply = sample_sizes(results)
    commits = {"enable.auto.commit": False} if after_delivery else {"enable.auto.commit": True,
                                                                    "auto.commit.interval.ms": 1000}
    consumer = Consumer(settings.kafka(**{"group.id": f"raw-echo-{requests}", "auto.offset.reset": "earliest",
                                          **commits}))
    producer = Producer(settings.kafka(**TUNED))
    consumer.subscribe([requests])
    consumed: dict[int, deque[int]] = defaultdict(deque)  # per request partition, in order
    delivered: dict[int, set[int]] = defaultdict(set)

    def on_delivery(partition: int, offset: int, err: KafkaError | None, _msg: Message) -> None:
        if err is None:  # a failed reply is never committed past (and this bench then never ends)
            delivered[partition].add(offset)

    next_commit = 0.0
    print("ready", flush=True)
    while True:
        for msg in consumer.consume(1000, 0.05):
            if msg.error() is not None:
                continue
            if not after_delivery:
                producer.produce(results, reply, key=msg.key())
                continue
            partition, offset = msg.partition(), msg.offset()
            assert partition is not None and offset is not None
            consumed[partition].append(offset)
            producer.produce(results, reply, key=msg.key(), on_delivery=partial(on_delivery, partition, offset))
        producer.poll(0)
        if after_delivery and time.monotonic() >= next_commit:
            next_commit = time.monotonic() + 0.005
            positions = []
            for partition, offsets in consumed.items():
                done, last = delivered[partition], None
                while offsets and offsets[0] in done:
                    last = offsets.popleft()
                    done.discard(last)
                if last is not None:
                    positions.append(TopicPartition(requests, partition, last + 1))
            if positions:
                consumer.commit(offsets=positions, asynchronous=True)


class RawEchoServer:
    def __init__(self, settings: KilnSettings, requests: str, results: str, after_delivery: bool = False) -> None:
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.raw_echo", "serve", requests, results,
                                      settings.bootstrap_servers, *(["after-delivery"] if after_delivery else [])],
                                     cwd=root, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def round_trips(settings: KilnSettings, requests: str, results: str, jobs: int, in_flight: int) -> float:
    """Jobs per second of ``jobs`` request → echo → reply round trips with at most ``in_flight`` outstanding."""
    request, _ = sample_sizes(results)
    consumer = Consumer(settings.kafka(**{"group.id": f"raw-client-{uuid.uuid4().hex[:6]}",
                                          "enable.auto.commit": False}))
    md = consumer.list_topics(results, timeout=15).topics[results]
    consumer.assign([TopicPartition(results, p, consumer.get_watermark_offsets(TopicPartition(results, p))[1])
                     for p in md.partitions])
    producer = Producer(settings.kafka(**TUNED))
    window = threading.Semaphore(in_flight)
    received = [0]

    def receive() -> None:
        while received[0] < jobs:
            for msg in consumer.consume(1000, 0.05):
                if msg.error() is None:
                    received[0] += 1
                    window.release()

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    started = time.monotonic()
    for i in range(jobs):
        while not window.acquire(timeout=0.001):
            producer.poll(0)
        producer.produce(requests, request, key=f"k{i % 8}".encode())
        if i % 100 == 0:
            producer.poll(0)
    producer.flush(60)
    reader.join(120)
    elapsed = time.monotonic() - started
    consumer.close()
    if received[0] < jobs:
        raise RuntimeError(f"raw echo: {received[0]} of {jobs} replies")
    return jobs / elapsed


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(KilnSettings(bootstrap_servers=sys.argv[4]), sys.argv[2], sys.argv[3], sys.argv[5:6] == ["after-delivery"])
