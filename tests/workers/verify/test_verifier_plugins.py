"""A verifier from a separate distribution plugs in through the ``kiln.verifiers`` entry point alone: installed next
to kiln, the verify stage serves tasks that name it, and its task source's tasks are verified through the stage
(the toy verifier in tests/fixtures/toy_verifier, the worked example of docs/architecture.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verify.client import VerifyClient
from tests.workers.verify.conftest import verify_worker

TOY = Path(__file__).resolve().parents[2] / "fixtures" / "toy_verifier"


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site, source = tmp_path_factory.mktemp("toy-verifier-site"), tmp_path_factory.mktemp("toy-src") / "toy"
    shutil.copytree(TOY, source)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)], check=True, capture_output=True)
    return site


async def test_a_separately_installed_verifier_serves_its_task_source(
        toy_site: Path, verify_settings: KilnSettings, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(toy_site))
    from kiln_wordlen.verifier import Sentences

    from kiln.rl.tasks import TaskSource

    source: TaskSource = Sentences(seed=1)
    tasks = source.sample(3) + source.held_out()
    with verify_worker(verify_settings, PYTHONPATH=str(toy_site)) as worker:
        worker.wait_assigned()
        async with KilnClient(verify_settings, f"toy-verifier-{unique}") as kiln:
            client = VerifyClient(kiln)
            for task in tasks:
                n = task.check["words"]
                verdicts = await client.verify(task, [" ".join(["w"] * n), " ".join(["w"] * (n + 1))])
                assert [(v.reward, v.failure, v.details["words"]) for v in verdicts] == [
                    (1.0, None, n), (0.0, None, n + 1)]
            typo = tasks[0].model_copy(update={"check": {"wrods": 3}})
            [unreadable] = await client.verify(typo, ["w w w"])
            assert unreadable.failure == "invalid_task" and "wrods" in unreadable.reason
