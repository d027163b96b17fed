"""A blob-store outage while claim-checking a large result fails that job with a typed error (after retries);
the worker goes on serving."""

from __future__ import annotations

import asyncio

import pytest

from kiln.schemas.builtin import EchoRequest
from kiln.streams.blobstore import S3BlobStore
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.settings import KilnSettings
from kiln.workers.builtin import echo
from tests.streams.harness import running_worker


async def test_a_result_that_cannot_be_claim_checked_fails_alone(kafka: KilnSettings, s3_settings: KilnSettings,  # type: ignore[no-untyped-def]
                                                                 topics, unique: str) -> None:
    request_topic, results = topics(partitions=1)
    settings = kafka.model_copy(update={"claim_check_bytes": 2000})
    gone = S3BlobStore.from_settings(s3_settings, f"kiln-missing-{unique}")  # its bucket does not exist
    async with running_worker(echo.stage, settings, request_topic, slots=2, blob_store=gone) as worker, \
            KilnClient(kafka, f"c-{unique}", results_topic=results) as client:
        with pytest.raises(RequestFailed, match="BlobUnavailable"):
            await asyncio.wait_for(client.call("echo", EchoRequest(data="x" * 5000), topic=request_topic), 120)
        small = await asyncio.wait_for(client.call("echo", EchoRequest(data="small"), topic=request_topic), 60)
        assert small.data == "small" and worker.failure is None
