"""The status page as a real process, a headless Chromium to load it, and where screenshots go."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.streams.processes import ServiceProcess
from kiln.streams.settings import KilnSettings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def output_dir() -> Path:
    """``KILN_TEST_OUTPUT`` or ``test-output/`` of the checkout: screenshots the tests save for people to look at."""
    path = Path(os.environ.get("KILN_TEST_OUTPUT", ROOT / "test-output"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def status_page(tmp_path: Path) -> Iterator[Callable[[KilnSettings], ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(settings: KilnSettings) -> ServiceProcess:
        page = ServiceProcess(["status", "serve"], "KILN_STATUS_PORT", settings, tmp_path / "status.log",
                              KILN_STATUS_REFRESH_S="1")
        started.append(page)
        page.wait_healthy()
        return page

    yield start
    for page in started:
        page.stop()


@pytest.fixture
def browser() -> Iterator[object]:
    """Debian's chromium, headless, driven by its chromedriver through Selenium (``kiln setup ops`` installs both)."""
    if shutil.which("chromedriver") is None or shutil.which("chromium") is None:
        pytest.fail("chromium/chromedriver missing: run `kiln setup ops`")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1500",
                     "--disable-gpu"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()
