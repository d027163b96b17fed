"""One rich repository, ingested once per session into a file store, shared by the reader and HTTP tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.streams.blobstore import FileBlobStore
from tests.ingest.gitrepos import rich_repository


@dataclass
class Ingested:
    source: Path
    store: SaucerStore
    event: IngestEvent


def ingest_into(store: SaucerStore, work: Path, request: IngestRequest) -> IngestEvent:
    return asyncio.run(ingest(request, f"req-{request.name}", store, work))


@pytest.fixture(scope="session")
def rich(tmp_path_factory: pytest.TempPathFactory) -> Ingested:
    root = tmp_path_factory.mktemp("saucer")
    rich_repository(root / "src")
    store = SaucerStore(FileBlobStore(root / "blobs"), root / "cache")
    event = ingest_into(store, root / "work", IngestRequest(name="acme/demo", location=str(root / "src")))
    assert event.status == "ingested", event
    return Ingested(root / "src", store, event)
