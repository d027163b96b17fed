"""Session fixtures: real services, started once per test session through the same infra scripts users run."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# testcontainers' reaper image comes from a hub this machine cannot reach; tests clean up after themselves.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
# Tests ingest repositories they create under the temp dir (worker processes inherit this); a deployment allows no
# local path unless configured.
os.environ.setdefault("KILN_INGEST_LOCAL_ROOTS", json.dumps([tempfile.gettempdir()]))

from kiln.streams import admin
from kiln.streams.infra import COMPONENT_STEPS, run_script, run_steps
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec
from kiln.workers.common.registry import Registry
from tests import collection, topic_hygiene

# Hypothesis's timing checks (input generation "too slow", per-example deadlines) measure the machine, not the code:
# the suite shares its cores with brokers, dockerd and the stages' workers. Properties are checked in full regardless.
settings.register_profile("kiln", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("kiln")

# Worker processes on per-test topics and the images they run, shared by tests/workers, tests/rl, tests/integrations.
pytest_plugins = ["tests.stages"]


def pytest_report_collectionfinish() -> list[str]:
    """Under "collected N items": the files a folder left out (tests/collection.py)."""
    return collection.summary()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """In the summary too, next to the skips: a folder that was not collected is never silent."""
    lines = collection.summary()
    if lines:
        terminalreporter.section("not collected")
        for line in lines:
            terminalreporter.write_line(line)


def _ensure(component: str) -> None:
    run_steps(COMPONENT_STEPS[component])


@pytest.fixture(scope="session")
def kafka() -> Iterator[KilnSettings]:
    """A running Apache Kafka broker on loopback; settings pointing at it. The session's test topics are deleted at
    its end (tests/topic_hygiene.py)."""
    _ensure("kafka")
    settings = KilnSettings(bootstrap_servers=os.environ.get("KILN_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    admin.wait_for_broker(settings)
    with topic_hygiene.session_topics(settings):
        yield settings


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[object]:
    """A docker SDK client on the local engine, with kiln's base images built."""
    import docker

    _ensure("docker")
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3_settings() -> KilnSettings:
    """Settings pointing at the real S3 server on loopback."""
    _ensure("s3")
    env = dict(line.split("=", 1) for line in run_script("s3/s3.sh", "env").split())
    return KilnSettings(
        s3_endpoint=env["KILN_S3_ENDPOINT"],
        s3_access_key=env["KILN_S3_ACCESS_KEY"],
        s3_secret_key=env["KILN_S3_SECRET_KEY"],
        s3_region=env["KILN_S3_REGION"],
    )


@pytest.fixture(scope="session")
def registry(s3_settings: KilnSettings, docker_engine: object) -> Registry:
    """The registry (storage on the S3 server) with its per-installation credentials."""
    _ensure("registry")
    env = dict(line.split("=", 1) for line in run_script("registry/registry.sh", "env").split())
    return Registry(env["KILN_BUILD_REGISTRY"], env["KILN_BUILD_REGISTRY_USER"],
                    env["KILN_BUILD_REGISTRY_PASSWORD"])


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic, group and bucket names, so tests never share state."""
    return topic_hygiene.unique_name()


@pytest.fixture
def topics(kafka: KilnSettings, unique: str):  # type: ignore[no-untyped-def]
    """Create fresh request (+ DLQ) and results topics for one test: ``topics(partitions=1)`` -> names.
    They are deleted afterwards, so the local broker does not accumulate partitions run after run."""
    created: list[str] = []

    def make(partitions: int = 1, results_partitions: int = 2) -> tuple[str, str]:
        request, results = f"req-{unique}", f"res-{unique}"
        specs = [TopicSpec(request, partitions), TopicSpec(f"{request}.dlq", 1),
                 TopicSpec(results, results_partitions)]
        admin.create_topics(kafka, specs)
        created.extend(s.name for s in specs)
        return request, results

    yield make
    for problem in admin.delete_topics(kafka, created) if created else []:
        print(f"could not delete a test topic: {problem}")  # cleanup only: a leftover topic harms nothing
