"""The stats app as a real process (``kiln stats serve``) on a topology under a test-unique prefix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.streams import admin
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import COMPACTED, STATS_TOPIC, WORKERS_TOPIC, TopicSpec


class StatsProcess:
    def __init__(self, settings: KilnSettings, log: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.streams.cli", "stats", "serve", "--verbose"],
            env={**os.environ, "KILN_TOPIC_PREFIX": settings.topic_prefix, "KILN_CACHE": str(settings.cache),
                 "KILN_STATS_PORT": str(self.port), "KILN_STATS_PUBLISH_S": "1", **env},
            stdout=log.open("w"), stderr=subprocess.STDOUT)

    def stage(self, stage: str) -> dict[str, Any]:
        try:
            response = httpx.get(f"{self.url}/stats/{stage}", timeout=5)
        except httpx.HTTPError:
            return {}
        return dict(response.json()) if response.status_code == 200 else {}

    def wait(self, stage: str, check: Callable[[dict[str, Any]], bool], timeout: float = 45) -> dict[str, Any]:
        """The stage's numbers once ``check`` holds for them."""
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"stats app exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            seen = self.stage(stage)
            if seen and check(seen):
                return seen
            time.sleep(0.5)
        raise AssertionError(f"stats for {stage} never matched; last: {seen}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def ops_topics(kafka: KilnSettings, unique: str, tmp_path: Path) -> Iterator[Callable[..., KilnSettings]]:
    """``ops_topics(("sleep.requests", 4))``: those topics (+ DLQ twins), kiln.results, kiln.workers and kiln.stats
    under a fresh prefix; everything under the prefix (faust's own topics too) is deleted afterwards."""
    settings = kafka.model_copy(update={"topic_prefix": f"t{unique}.", "cache": tmp_path / "cache"})

    def make(*topics: tuple[str, int]) -> KilnSettings:
        specs = [TopicSpec("kiln.results", 2), TopicSpec(WORKERS_TOPIC, 1, COMPACTED),
                 TopicSpec(STATS_TOPIC, 1, COMPACTED)]
        for name, partitions in topics:
            specs += [TopicSpec(name, partitions), TopicSpec(f"{name}.dlq", 1)]
        admin.create_topics(settings, specs)
        return settings

    yield make
    names = admin.admin_client(settings).list_topics(timeout=10).topics
    admin.delete_topics(settings, [n for n in names if n.startswith(settings.topic_prefix)])


@pytest.fixture
def stats_process(tmp_path: Path) -> Iterator[Callable[..., StatsProcess]]:
    started: list[StatsProcess] = []

    def start(settings: KilnSettings, **env: str) -> StatsProcess:
        process = StatsProcess(settings, tmp_path / f"stats-{len(started)}.log", **env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
