"""``kiln tail``'s reading of records, directly (streams/status/records.py, tail.py, dlq.select): every kind of
record on a real topic decoded, summarised and filtered; the last N per partition, or from the start."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from kiln.schemas.envelope import ErrorInfo, RequestEnvelope, ResultEnvelope
from kiln.schemas.ops import StageStats, WorkerHeartbeat
from kiln.schemas.tasks import TaskHealth
from kiln.streams.errors import ConfigError
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TASK_HEALTH_TOPIC
from kiln.streams.status.dlq import select
from kiln.streams.status.records import DLQ_HEADER
from kiln.streams.status.tail import Filter, tail


def _records(settings: KilnSettings) -> dict[str, RequestEnvelope | ResultEnvelope]:
    request = RequestEnvelope(kind="sleep", client_id="alice", payload={"seconds": 1})
    redriven = RequestEnvelope(kind="sleep", client_id="bob", payload={}, attempt=2, redriven_from=request.request_id)
    result = ResultEnvelope(request_id=request.request_id, kind="sleep", client_id="alice", status="error",
                            worker="w1", error=ErrorInfo(type="Timeout", message="took too long"))
    producer = Producer(settings.kafka())
    topic = settings.topic("sleep.requests")
    beat = WorkerHeartbeat(worker="w1", stage="sleep", topic=topic, group="g", slots=4, busy=1, state="ok",
                           interval_s=5, at=1.0)
    stats = StageStats(stage="sleep", at=1.0, window_s=60, queue_length=3, completions_per_min=2.5,
                       completions_total=9, workers_avg=1, slots_avg=4, busy_avg=1, workers_now=1, slots_now=4,
                       busy_now=1)
    for value, headers in ((request.model_dump_json(), None), (redriven.model_dump_json(), None),
                           (result.model_dump_json(), None), (beat.model_dump_json(), None),
                           (stats.model_dump_json(), None), (json.dumps({"a": 1}), None), (b"\xff\x00raw", None),
                           (None, None),
                           (request.model_dump_json(), [(DLQ_HEADER, b"timeout"), ("kiln-attempts", b"3"),
                                                        ("kiln-error-message", b"gave up")]),
                           (b"not json", [(DLQ_HEADER, b"malformed"), ("kiln-stage", b"sleep")])):
        producer.produce(topic, value=value, key=b"k", partition=0, headers=headers)
    assert producer.flush(30) == 0
    return {"request": request, "redriven": redriven, "result": result}


def test_every_kind_of_record_is_decoded_and_summarised(ops_topics: Callable[..., KilnSettings]) -> None:
    settings = ops_topics(("sleep.requests", 2))
    sent = _records(settings)
    request, result = sent["request"], sent["result"]
    got = list(tail(settings, "sleep.requests", from_beginning=True))
    assert [r.type for r in got] == ["request", "request", "result", "heartbeat", "stats", "json", "bytes",
                                     "tombstone", "dead-letter", "dead-letter"]
    assert [r.offset for r in got] == list(range(10)) and all(r.partition == 0 and r.key == "k" for r in got)
    lines = [r.summary() for r in got]
    assert lines[0] == f"request {request.request_id} kind=sleep client=alice attempt=0"
    assert lines[1].endswith(f"attempt=2 redriven_from={request.request_id}")
    assert lines[2] == (f"result {request.request_id} kind=sleep client=alice status=error worker=w1 Timeout: "
                        "took too long")
    assert lines[3] == "heartbeat w1 stage=sleep ok busy 1/4"
    assert lines[4] == "stats sleep queue=3 done/min=2.5 workers=1 busy 1/4"
    assert lines[5] == 'json {"a": 1}' and lines[6] == "bytes b'\\xff\\x00raw'" and lines[7] == "tombstone key=k"
    assert lines[8] == (f"dead letter {request.request_id} kind=sleep client=alice reason=timeout attempts=3: "
                        "gave up")
    assert lines[9] == "dead letter (malformed) reason=malformed attempts=None: "
    assert got[9].fields == {"reason": "malformed", "kind": "sleep"}
    assert got[2].as_json()["value"]["status"] == "error" and got[6].as_json()["value"] == "b'\\xff\\x00raw'"
    # What tail filters on: kind, client, a request id (also as the original of a redriven request).
    by_id = [r.offset for r in tail(settings, "sleep.requests", from_beginning=True,
                                    keep=Filter(request_id=request.request_id))]
    assert by_id == [0, 1, 2, 8]
    assert [r.offset for r in tail(settings, "sleep.requests", from_beginning=True,
                                   keep=Filter(client="bob"))] == [1]
    assert [r.offset for r in tail(settings, "sleep.requests", from_beginning=True,
                                   keep=Filter(kind="sleep", client="alice"))] == [0, 2, 8]
    assert result.request_id == request.request_id
    dead = [r for r in got if r.type == "dead-letter"]
    assert select(dead, reasons=["timeout"]) == [dead[0]] and select(dead, offsets=[9]) == [dead[1]]
    assert select(dead, request_ids=[request.request_id], reasons=["malformed"]) == []


def test_task_health_records_are_decoded(ops_topics: Callable[..., KilnSettings]) -> None:
    settings = ops_topics()
    health = TaskHealth(task_id="a/one:7", source="a/one", status="quarantined", reason="flaky", runs=5,
                        gold_passed_runs=3, updated_at=1.0)
    producer = Producer(settings.kafka())
    producer.produce(settings.topic(TASK_HEALTH_TOPIC), key=b"a/one:7", value=health.model_dump_json())
    assert producer.flush(30) == 0
    [got] = tail(settings, TASK_HEALTH_TOPIC, from_beginning=True)
    assert (got.type, got.model, got.key) == ("task-health", health, "a/one:7")
    assert got.summary() == "task-health a/one:7 quarantined reason=flaky gold runs passed 3/5 kiln failures=0"


def test_tail_reads_the_last_records_of_each_partition_or_refuses_an_unknown_topic(
        ops_topics: Callable[..., KilnSettings]) -> None:
    settings = ops_topics(("sleep.requests", 2))
    producer = Producer(settings.kafka())
    for i in range(10):
        producer.produce(settings.topic("sleep.requests"), value=json.dumps({"i": i}).encode(), partition=i % 2)
    assert producer.flush(30) == 0
    last = sorted(r.body["i"] for r in tail(settings, "sleep.requests", last=2))
    assert last == [6, 7, 8, 9]  # two from each partition's end
    assert len(list(tail(settings, "sleep.requests", last=100))) == 10
    assert list(tail(settings, "kiln.results")) == []  # an empty topic: nothing, and no wait
    with pytest.raises(ConfigError, match="does not exist"):
        list(tail(settings, "no.such.topic"))
