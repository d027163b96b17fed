"""The status page in a real browser against live workers: the numbers it shows equal those of the jobs this test
submitted and the records on the topics; a screenshot is saved. ``kiln status`` prints the same numbers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from kiln.schemas.builtin import SleepRequest
from kiln.schemas.envelope import ResultEnvelope
from kiln.schemas.tasks import TaskHealth
from kiln.streams.client import KilnClient
from kiln.streams.processes import ServiceProcess, StatsProcess, WorkerProcess
from kiln.streams.producer import publish_records
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TASK_HEALTH_TOPIC
from tests.streams.harness import read_all

FAST = {"KILN_HEARTBEAT_S": "1"}


async def _run(settings: KilnSettings, requests: list[SleepRequest]) -> list[ResultEnvelope]:
    async with KilnClient(settings) as client:
        futures = [await client.submit("sleep", r) for r in requests]
        return list(await asyncio.gather(*futures))


def _shown(driver: Any, field: str, stage: str = "sleep") -> str:
    found = driver.find_elements(By.CSS_SELECTOR, f'[data-stage="{stage}"][data-field="{field}"]')
    return str(found[0].text) if found else ""


def test_status_page_shows_what_ran(ops_topics: Callable[..., KilnSettings],
                                    stats_process: Callable[..., StatsProcess],
                                    status_page: Callable[[KilnSettings], ServiceProcess], browser: Any,
                                    output_dir: Path, tmp_path: Path) -> None:
    settings = ops_topics(("sleep.requests", 4))
    stats = stats_process(settings)
    env = {"KILN_TOPIC_PREFIX": settings.topic_prefix, **FAST}
    workers = [WorkerProcess("sleep", settings, "sleep.requests", slots=slots, env=env) for slots in (2, 3)]
    try:
        for w in workers:
            w.wait_assigned()
        requests = ([SleepRequest(seconds=0.2, tag=f"ok{i}") for i in range(10)]
                    + [SleepRequest(seconds=0.01, fail="permanent", tag=f"bad{i}") for i in range(3)]
                    + [SleepRequest(seconds=0.01, fail="transient", fail_attempts=1, tag="retried")])
        results = asyncio.run(_run(settings, requests))
        producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
        producer.produce(settings.topic("sleep.requests"), b"{not an envelope")
        producer.flush(10)

        # What the topics say, independently of the stats stream.
        ok = [r for r in results if r.status == "ok"]
        failed = Counter(r.error.type for r in results if r.error is not None)
        dead = read_all(settings, settings.topic("sleep.requests.dlq"), expect=4)
        attempts = Counter(str(r.result["attempt"]) for r in ok if r.result)
        assert len(ok) == 11 and failed == {"PermanentJobError": 3} and len(dead) == 4

        # Per-minute numbers count complete 10 s buckets: wait until every job is inside the last minute.
        stats.wait("sleep", lambda s: s["completions_total"] == 14 and s["dead_letters_total"] == 4
                   and s["workers_now"] == 2 and s["completions_per_min"] == 14)
        page = status_page(settings)
        browser.get(page.url)
        WebDriverWait(browser, 30).until(lambda d: _shown(d, "completions_total") == "14"
                                         and _shown(d, "dead_letters_total") == "4")
        assert _shown(browser, "workers_now") == "2"
        assert _shown(browser, "busy_slots").endswith("/ 5")
        assert _shown(browser, "queue_length") == "0" and _shown(browser, "completions_per_min") == "14"
        assert _shown(browser, "failures.PermanentJobError.0") == str(failed["PermanentJobError"])
        assert _shown(browser, "job_seconds") != "– / –"
        assert _shown(browser, "failures.PermanentJobError.1") == str(failed["PermanentJobError"])
        for attempt, count in attempts.items():  # the sleep stage's facet: results by the attempt that succeeded
            assert _shown(browser, f"facets.attempt.{attempt}.1") == str(count)
        assert float(_shown(browser, "values.slept_s.1")) > 0
        assert _shown(browser, "keeping_up") == "keeping up"
        rows = browser.find_elements(By.CSS_SELECTOR, "#workers tbody tr")
        assert len(rows) == 2
        WebDriverWait(browser, 15).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "svg.spark polyline")) > 0)
        screenshot = output_dir / "status-page.png"
        assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000

        table = subprocess.run([sys.executable, "-m", "kiln.streams.cli", "status", "--svg",
                                str(output_dir / "kiln-status.svg")],
                               env={**os.environ, "KILN_TOPIC_PREFIX": settings.topic_prefix},
                               capture_output=True, text=True, timeout=120, check=True).stdout
        cells = [c.strip() for c in next(line for line in table.splitlines() if "sleep" in line).split("│")[1:-1]]
        # stage, queue, done/min, busy/slots, workers, p50 / p99, failures/min, DLQ, done, keeping up
        assert cells[0] == "sleep" and cells[4] == "2" and cells[7] == "4" and cells[8] == "14", table
    finally:
        WorkerProcess.stop_all(workers)



def _task(task_id: str, status: str, reason: str | None = None, infra_failures: int = 0) -> TaskHealth:
    return TaskHealth.model_validate({"task_id": task_id, "source": task_id.partition(":")[0], "status": status,
                                      "reason": reason, "infra_failures": infra_failures, "updated_at": 1.0})


def test_status_page_shows_each_task_sources_healthy_share(ops_topics: Callable[..., KilnSettings],
                                                           status_page: Callable[[KilnSettings], ServiceProcess],
                                                           browser: Any, output_dir: Path) -> None:
    """Records as ``kiln tasks health`` writes them, a later record replacing an earlier one, a tombstone forgetting a
    task and one record no reader can read (counted quarantined, as task sources treat it): the page's per-source
    counts and healthy share are those of the latest record per task."""
    settings = ops_topics()
    records = [_task("a/one:1", "quarantined", "flaky"), _task("a/one:1", "healthy"), _task("a/one:2", "healthy"),
               _task("a/one:3", "quarantined", "gold_fails"), _task("a/one:4", "healthy"),
               _task("b/two:1", "unchecked", infra_failures=3), _task("b/two:2", "quarantined", "operator")]
    publish_records(settings, TASK_HEALTH_TOPIC, [(r.task_id, r) for r in records], "test-tasks")
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    producer.produce(settings.topic(TASK_HEALTH_TOPIC), key=b"a/one:4", value=None)  # forgotten
    producer.produce(settings.topic(TASK_HEALTH_TOPIC), key=b"b/two:3", value=b'{"task_id": "b/two:3", "new": 1}')
    producer.flush(10)
    page = status_page(settings)
    browser.get(page.url)

    def cell(source: str, field: str) -> str:
        found = browser.find_elements(By.CSS_SELECTOR, f'[data-source="{source}"][data-field="{field}"]')
        return str(found[0].text) if found else ""
    WebDriverWait(browser, 30).until(lambda d: cell("b/two", "tasks") == "3")
    assert [cell("a/one", f) for f in ("tasks", "healthy", "quarantined", "unchecked", "healthy_share", "reasons")] == [
        "3", "2", "1", "0", "67 %", "gold_fails 1"]
    assert [cell("b/two", f) for f in ("healthy", "quarantined", "unchecked", "healthy_share", "reasons",
                                       "kiln_failures")] == ["0", "2", "1", "0 %", "operator 1, unreadable 1", "3"]
    screenshot = output_dir / "status-page-tasks.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
