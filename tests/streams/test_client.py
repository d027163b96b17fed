"""The client's results contract: results nobody claims cannot pin the client's offset forever, and in ack mode a
result counts as delivered only once the application acknowledges it (so a crash right after a future resolved
loses nothing)."""

from __future__ import annotations

import asyncio

from confluent_kafka import Consumer, Producer, TopicPartition

from kiln.schemas.builtin import EchoRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.streams import codec
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import echo
from tests.streams.harness import running_worker


def _committed_and_end(settings: KilnSettings, client_id: str, topic: str, partition: int) -> tuple[int, int]:
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"kiln-client.{client_id}"})
    try:
        tp = TopicPartition(topic, partition)
        committed = consumer.committed([tp], timeout=10)[0].offset
        return committed, consumer.get_watermark_offsets(tp, timeout=10)[1]
    finally:
        consumer.close()


async def _results_of_a_previous_life(kafka: KilnSettings, client_id: str, request_topic: str, results: str,
                                      n: int) -> set[str]:
    """``n`` requests whose client process 'crashes' before their results arrive; returns their ids."""
    first = KilnClient(kafka, client_id, results_topic=results)
    for i in range(n):
        await first.submit("echo", EchoRequest(data=i), topic=request_topic)
    ids = set(first._state.pending)  # type: ignore[union-attr]
    await first.close()
    return ids


async def test_unclaimed_results_are_surfaced_and_committed_past(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=2, results_partitions=2)
    client_id = f"trainer-{unique}"
    ids = await _results_of_a_previous_life(kafka, client_id, request_topic, results, 5)
    surfaced: list[ResultEnvelope] = []
    # This life never drains unclaimed(): past their age the old results are handed to the callback.
    async with running_worker(echo.stage, kafka, request_topic, slots=4), \
            KilnClient(kafka, client_id, results_topic=results, unclaimed_max_age_s=1.0,
                       on_unclaimed=surfaced.append) as client:
        assert (await client.call("echo", EchoRequest(data="now"), topic=request_topic)).data == "now"
        for _ in range(100):
            if len(surfaced) == 5:
                break
            await asyncio.sleep(0.1)
        partition = client._state.partition  # type: ignore[union-attr]
    assert {e.request_id for e in surfaced} == ids
    committed, end = _committed_and_end(kafka, client_id, results, partition)
    assert committed == end  # nothing pinned: a restart has nothing to re-read


async def test_ack_mode_redelivers_what_was_not_acknowledged(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    request_topic, results = topics(partitions=1, results_partitions=2)
    client_id = f"trainer-{unique}"
    async with running_worker(echo.stage, kafka, request_topic, slots=2):
        async with KilnClient(kafka, client_id, results_topic=results, ack_mode=True) as client:
            fut_a = await client.submit("echo", EchoRequest(data="a"), topic=request_topic)
            fut_b = await client.submit("echo", EchoRequest(data="b"), topic=request_topic)
            a, b = await fut_a, await fut_b
            client.ack(a.request_id)  # the trainer used a durably; it "crashes" before finishing with b
        async with KilnClient(kafka, client_id, results_topic=results, ack_mode=True) as second:
            again = await asyncio.wait_for(anext(aiter(second.unclaimed())), 30)
            assert again.request_id == b.request_id and second.result_of(again).data == "b"
            second.ack(again.request_id)
        async with KilnClient(kafka, client_id, results_topic=results, ack_mode=True) as third:
            partition = third._state.partition  # type: ignore[union-attr]
    committed, end = _committed_and_end(kafka, client_id, results, partition)
    assert committed == end


async def test_a_replayed_result_is_not_delivered_again_in_the_next_life(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                           unique: str) -> None:
    """A worker killed after publishing a result but before committing its job runs it again and publishes a
    second result; when that copy arrives after the client restarted, the new life must not deliver it again."""
    request_topic, results = topics(partitions=1, results_partitions=2)
    client_id = f"trainer-{unique}"
    async with running_worker(echo.stage, kafka, request_topic, slots=2):
        async with KilnClient(kafka, client_id, results_topic=results) as first:
            delivered = await (await first.submit("echo", EchoRequest(data="once"), topic=request_topic))
            partition = first._state.partition  # type: ignore[union-attr]
        replay = delivered.model_copy(update={"worker": "the-replaying-worker"})
        not_yet = ResultEnvelope(request_id="never-delivered", kind="echo", client_id=client_id, status="ok",
                                 result={"data": "later"}, attempts=1, worker="w")
        producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
        for envelope in (replay, not_yet):
            producer.produce(results, codec.encode(envelope, None, kafka.claim_check_bytes), key=client_id,
                             partition=partition)
        producer.flush(10)
        async with KilnClient(kafka, client_id, results_topic=results) as second:
            first_unclaimed = await asyncio.wait_for(anext(aiter(second.unclaimed())), 30)
    assert first_unclaimed.request_id == "never-delivered"


async def test_concurrent_first_uses_start_one_client(kafka: KilnSettings, topics, unique: str) -> None:  # type: ignore[no-untyped-def]
    """A trainer that drains unclaimed() in one task while submitting in another must get one consumer: two would
    both read the results partition and deliver a request's result once to each."""
    _request_topic, results = topics(partitions=1, results_partitions=2)
    client = KilnClient(kafka, f"trainer-{unique}", results_topic=results)
    starts: list[object] = []
    real_start = client._start

    async def counting_start(loop):  # type: ignore[no-untyped-def]
        starts.append(loop)
        return await real_start(loop)

    client._start = counting_start  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(client._ready() for _ in range(3)))
    finally:
        await client.close()
    assert len(starts) == 1
