"""A stage from a separate distribution plugs in through the ``kiln.stages`` entry point alone: its topics are
created, it is served, replayed and shown in metrics, and the client routes and types its requests, without a
line of kiln changed (the toy stage in tests/fixtures/toy_stage, the worked example of docs/architecture.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import stage_specs, topology

TOY = Path(__file__).resolve().parents[1] / "fixtures" / "toy_stage"


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy distribution installed (like any pip install) into a directory of its own."""
    site, source = tmp_path_factory.mktemp("toy-site"), tmp_path_factory.mktemp("toy-src") / "toy"
    shutil.copytree(TOY, source)  # setuptools builds in the source tree: not in the repository's
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)], check=True, capture_output=True)
    return site


@pytest.fixture
def prefixed(kafka: KilnSettings, unique: str, tmp_path: Path) -> Iterator[KilnSettings]:
    settings = kafka.model_copy(update={"topic_prefix": f"t{unique}.", "cache": tmp_path / "cache"})
    yield settings
    names = set(admin.admin_client(settings).list_topics(timeout=10).topics)
    admin.delete_topics(settings, [n for n in names if n.startswith(settings.topic_prefix)])


def _kiln(site: Path, settings: KilnSettings, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(site), "KILN_TOPIC_PREFIX": settings.topic_prefix,
           "KILN_BOOTSTRAP_SERVERS": settings.bootstrap_servers, "KILN_BLOB_STORE": f"file://{settings.cache}/b",
           "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "kiln.streams.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


async def test_a_separately_installed_stage_is_created_served_replayed_and_measured(
        toy_site: Path, prefixed: KilnSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "wordcount" not in stage_specs()  # not part of kiln
    assert "wordcount.requests" in _kiln(toy_site, prefixed, "stages")
    _kiln(toy_site, prefixed, "topics", "create")
    md = admin.admin_client(prefixed).list_topics(timeout=10).topics
    assert len(md[prefixed.topic("wordcount.requests")].partitions) == 4
    assert prefixed.topic("wordcount.requests.dlq") in md and prefixed.topic("kiln.results") in md

    monkeypatch.syspath_prepend(str(toy_site))  # this process (the trainer) has it installed too
    from kiln_wordcount.client import WordCountClient
    from kiln_wordcount.spec import CountResult

    assert prefixed.topic("wordcount.requests") in {prefixed.topic(t.name) for t in topology()}
    port = free_port()
    env = {"PYTHONPATH": str(toy_site), "KILN_TOPIC_PREFIX": prefixed.topic_prefix, "KILN_METRICS_PORT": str(port)}
    with WorkerProcess("wordcount", prefixed, "wordcount.requests", slots=2, env=env) as worker:
        worker.wait_assigned()
        async with KilnClient(prefixed, "toy-trainer") as kiln:
            counts = WordCountClient(kiln)
            first = await counts.count("kiln plugs in stages")
            second = await counts.count("one two three")
            with pytest.raises(RequestFailed, match="nothing to count"):
                await counts.count("   ")
        assert isinstance(first, CountResult) and (first.words, first.longest) == (4, "stages")
        assert second.words == 3 and not second.replayed
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
        assert 'stage="wordcount"' in metrics and "kiln_wordcount_words_total 7.0" in metrics
        assert worker.terminate() == 0

    replayed = _kiln(toy_site, prefixed, "replay", "wordcount.requests", "--from-beginning")
    assert "replayed 3 messages: 2 ok, 1 failed, 0 malformed" in replayed
