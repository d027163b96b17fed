"""Dead letters: the record of a job that failed for good (or could not be read), written to the stage's
``<topic>.dlq`` with the reason and the source coordinates in ``kiln-*`` headers and bounded copies of the request's
key, headers and value (what does not fit is claim-checked, or cut with its size recorded)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random

from confluent_kafka import Message

from kiln.schemas.envelope import ErrorInfo
from kiln.streams.blobstore import BlobStore
from kiln.streams.errors import BlobError, BrokerUnavailable
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.producer import RETRY_FIRST_S, WorkerProducer, backoff

log = logging.getLogger("kiln.executor")
DLQ_VALUE_LIMIT = 900_000
"""Largest request value copied into a dead letter as is (the producer refuses ~1 MB; key and headers need room):
above it the dead letter carries a claim check (or, without a blob store, a truncated copy) and the source
coordinates."""
DLQ_KEY_LIMIT = 4096
"""Largest request key copied into a dead letter as is; a longer one is cut to this, its size recorded
(``kiln-dlq-original-key-bytes``) and the whole key claim-checked (``kiln-dlq-key-claim-check``)."""
DLQ_HEADERS_LIMIT = 32 * 1024
"""Most bytes of the request's own headers (names and values) copied into a dead letter: past it they are cut, their
total size and count recorded (``kiln-dlq-original-headers-bytes``, ``-count``) and all of them claim-checked as
JSON ``[[name, base64 value], ...]`` (``kiln-dlq-headers-claim-check``). Key, headers and value together stay
under the producer's 1 MB."""
_HEADER_NAME_LIMIT = 256


class DeadLetterWriter:
    """Writes the dead letters of one stage's worker to ``dlq_topic`` through the worker's producer."""

    def __init__(self, producer: WorkerProducer, metrics: WorkerMetrics, stage: str, worker_id: str, dlq_topic: str,
                 blob_store: BlobStore | None) -> None:
        self.producer = producer
        self.metrics = metrics
        self.stage = stage
        self.worker_id = worker_id
        self.dlq_topic = dlq_topic
        self.blob_store = blob_store

    async def write(self, msg: Message, error: ErrorInfo, attempts: int) -> None:
        """Write the dead letter of ``msg``: the reason and source coordinates in ``kiln-*`` headers, bounded copies of
        its key, headers and value (sizes recorded, the rest claim-checked). A record the broker refuses anyway is
        replaced by a minimal one (reason and coordinates only); an outage is retried with backoff. Never raises but
        ``CancelledError``."""
        meta = [
            ("kiln-error-type", error.type.encode()[:256]),
            ("kiln-error-message", error.message.encode()[:4000]),
            ("kiln-stage", self.stage.encode()),
            ("kiln-attempts", str(attempts).encode()),
            ("kiln-source-topic", str(msg.topic()).encode()),
            ("kiln-source-partition", str(msg.partition()).encode()),
            ("kiln-source-offset", str(msg.offset()).encode()),
            ("kiln-worker", self.worker_id.encode()),
        ]
        try:
            key, value, extra, original = await self._bounded_copies(msg)
        except Exception as e:  # nothing about the record may stop its dead letter: fall back to the minimal one
            log.exception("dead letter of %s[%s]@%s: copying the record failed", msg.topic(), msg.partition(),
                          msg.offset())
            key, value, extra, original = None, b"", [("kiln-dlq-refused", f"copy failed: {e!r}"[:1000].encode())], []
        headers = meta + extra + original
        delay = RETRY_FIRST_S
        minimal = False
        while True:
            try:
                await self.producer.produce(self.dlq_topic, value, key=key, headers=headers)
                break
            except BrokerUnavailable as e:
                self.metrics.delivery_retried("dead letter")
                log.warning("dead letter not delivered yet (retrying in about %.1f s): %s", delay, e)
            except Exception as e:  # DeliveryRefused, or anything librdkafka raised that no class foresaw
                if not minimal:
                    log.warning("dead letter of %s[%s]@%s refused (%s): writing a minimal one", msg.topic(),
                                msg.partition(), msg.offset(), e)
                    minimal = True
                    key, value = None, b""
                    headers = [*meta, ("kiln-dlq-refused", str(e).encode()[:1000])]
                    continue
                # Not even reason and coordinates: the dead-letter topic is missing or not writable. A deployment
                # fault; the partition waits for it, the worker stays up.
                self.metrics.delivery_retried("dead letter")
                log.error("the dead-letter topic %s refuses records (retrying in about %.1f s): %s", self.dlq_topic,
                          delay, e)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = backoff(delay)
        self.metrics.dead_lettered(error.type)

    async def _bounded_copies(self, msg: Message) -> tuple[bytes | None, bytes, list[tuple[str, bytes]],
                                                           list[tuple[str, bytes]]]:
        """Key, value, headers describing what was cut, and the request's own headers, each within its limit
        (``DLQ_KEY_LIMIT``, ``DLQ_VALUE_LIMIT``, ``DLQ_HEADERS_LIMIT``); what does not fit is claim-checked whole
        (or, without a blob store or while it is down, only cut, with its size recorded)."""
        extra: list[tuple[str, bytes]] = []
        key = msg.key()
        if key is not None and len(key) > DLQ_KEY_LIMIT:
            extra.append(("kiln-dlq-original-key-bytes", str(len(key)).encode()))
            await self._claim_check(extra, "kiln-dlq-key-claim-check", key)
            key = key[:DLQ_KEY_LIMIT]
        raw_headers = msg.headers() or []
        pairs = raw_headers.items() if isinstance(raw_headers, dict) else raw_headers
        original = [(str(k), v if isinstance(v, bytes) else str(v or "").encode()) for k, v in pairs]
        total = sum(len(k.encode()) + len(v) for k, v in original)
        if total > DLQ_HEADERS_LIMIT or any(len(k) > _HEADER_NAME_LIMIT for k, _ in original):
            extra += [("kiln-dlq-original-headers-bytes", str(total).encode()),
                      ("kiln-dlq-original-headers-count", str(len(original)).encode())]
            everything = json.dumps([[k, base64.b64encode(v).decode()] for k, v in original]).encode()
            await self._claim_check(extra, "kiln-dlq-headers-claim-check", everything)
            kept: list[tuple[str, bytes]] = []
            room = DLQ_HEADERS_LIMIT
            for name, data in original:
                name = name[:_HEADER_NAME_LIMIT]
                if room <= len(name.encode()):
                    break
                room -= len(name.encode())
                kept.append((name, data[:room]))
                room -= len(kept[-1][1])
            original = kept
        value = msg.value() or b""
        if len(value) > DLQ_VALUE_LIMIT:
            extra.append(("kiln-dlq-original-bytes", str(len(value)).encode()))
            if await self._claim_check(extra, "kiln-dlq-claim-check", value):
                value = b""
            else:
                extra.append(("kiln-dlq-truncated", b"true"))
                value = value[:DLQ_VALUE_LIMIT]
        return key, value, extra, original

    async def _claim_check(self, extra: list[tuple[str, bytes]], header: str, data: bytes) -> bool:
        """Store ``data`` in the blob store and name its digest in ``header``; False without a store or when the
        store fails (recorded in ``kiln-dlq-claim-check-error``): the caller keeps a cut copy."""
        if self.blob_store is None:
            return False
        store = self.blob_store
        try:
            digest = (await asyncio.to_thread(store.put, data)).digest
        except BlobError as e:
            extra.append(("kiln-dlq-claim-check-error", str(e).encode()[:1000]))
            return False
        extra.append((header, digest.encode()))
        return True
