"""Re-scoring by replay: a verifier with a planted bug (it also accepts the answer with a "0" appended) scores a batch
through a real verify worker; after the fix, ``kiln verify rescore`` re-checks the stored requests and changes
exactly the planted verdicts — no other completion of the planted verifier, no verdict of another verifier — and
its report and ``verify.rescored`` name the old and the new version. A training step's request (its groups of both
verifiers in one) is re-scored the same, its changes by position in its verdicts."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from kiln.schemas.rl import RolloutTask
from kiln.schemas.verify import CompletionVerdict, RescoredRequest
from kiln.streams import codec
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.replay import read_topic
from kiln.streams.settings import KilnSettings
from kiln.workers.verify import cli
from kiln.workers.verify.client import VerifyClient
from tests.workers.verify.conftest import verify_worker

BUGGY = '''\
from kiln.workers.verifiers import Verdict


class Planted:
    async def verify(self, task, completions, request_id):
        return [Verdict(reward=1.0 if c.strip() in (task.answer, task.answer + "0") else 0.0) for c in completions]

    async def close(self):
        pass


def factory(context):
    return Planted()
'''
FIXED = BUGGY.replace('c.strip() in (task.answer, task.answer + "0")', "c.strip() == task.answer")


def plant(site: Path, source: str) -> None:
    """A ``kiln.verifiers`` plugin named ``planted`` installed in ``site`` (a dist-info, as pip would leave it)."""
    (site / "kiln_planted").mkdir(parents=True, exist_ok=True)
    (site / "kiln_planted" / "__init__.py").write_text("")
    (site / "kiln_planted" / "verifier.py").write_text(source)
    info = site / "kiln_planted-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kiln-planted\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kiln.verifiers]\nplanted = kiln_planted.verifier:factory\n")


def batch() -> list[tuple[RolloutTask, list[str]]]:
    """Planted tasks (right, the planted "0" form, wrong, empty) and exact_match tasks with the same completions."""
    out = []
    for n in range(1, 9):
        a = str(n * 3)
        completions = [a, a + "0", str(n * 3 + 1), ""]
        out.append((RolloutTask(task_id=f"planted-{n}", prompt=f"{n}*3=", answer=a, verifier="planted"), completions))
        out.append((RolloutTask(task_id=f"exact-{n}", prompt=f"{n}*3=", answer=a), completions))
    return out


async def invoke(*args: str) -> Result:
    """``kiln verify ARGS`` in this process (its own event loop, so in a thread), on a wide terminal."""
    return await asyncio.to_thread(CliRunner().invoke, cli.app, list(args), env={"COLUMNS": "200"})


def planted(task: RolloutTask, completion: str) -> bool:
    return task.verifier == "planted" and completion == task.answer + "0"


@pytest.fixture
def settings(stage_topics: Callable[..., KilnSettings]) -> KilnSettings:
    return stage_topics(("verify.requests", 4), ("verify.rescored", 2))


async def test_rescoring_after_a_fix_changes_exactly_the_planted_verdicts(
        settings: KilnSettings, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    plant(site, BUGGY)
    work = batch()
    with verify_worker(settings, PYTHONPATH=str(site)) as worker:
        worker.wait_assigned()
        # Half the requests travel as claim checks (their payload in the blob store): re-scoring reads them back.
        checked = settings.model_copy(update={"claim_check_bytes": 1})
        async with KilnClient(settings, f"planted-{unique}") as kiln, \
                KilnClient(checked, f"planted-cc-{unique}", blob_store=open_blob_store(settings)) as kiln_cc:
            clients = VerifyClient(kiln), VerifyClient(kiln_cc)
            scored: list[list[CompletionVerdict]] = await asyncio.gather(
                *(clients[i % 2].verify(t, c) for i, (t, c) in enumerate(work)))
            # And the same groups as a training step: one request of them all, both verifiers.
            stepped = await clients[0].verify_batch([t for t, c in work for _ in c], [x for _, c in work for x in c])
    assert [v.reward for v in stepped] == [v.reward for verdicts in scored for v in verdicts]
    for (task, completions), verdicts in zip(work, scored, strict=True):
        assert [v.reward for v in verdicts] == [1.0 if c == task.answer or planted(task, c) else 0.0
                                                for c in completions]
        assert {v.verifier for v in verdicts} == {task.verifier} and all(v.version for v in verdicts)
    stored = [codec.decode_request(r.value()) for r in read_topic(settings, "verify.requests")]
    assert sum(e.claim_check is not None for e in stored) == len(work) // 2 and len(stored) == len(work) + 1
    old = {t.verifier: v[0].version for (t, _), v in zip(work, scored, strict=True)}

    plant(site, FIXED)  # the fix: the worker is gone, the command runs with the fixed verifier installed here
    monkeypatch.syspath_prepend(str(site))
    sys.modules.pop("kiln_planted.verifier", None)
    monkeypatch.setattr(cli, "get_settings", lambda: settings)
    run = await invoke("rescore", "--json")
    assert run.exit_code == 0, run.output
    report = json.loads(run.stdout)

    n_planted = sum(planted(t, c) for t, cs in work for c in cs)
    requests = len(work) + 1  # and the step's
    assert (report["requests"], report["completions"], report["published"]) == (requests, 8 * len(work), requests)
    assert (report["changed"], report["without_before"], report["malformed"]) == (2 * n_planted, 0, 0)
    [change] = report["transitions"]
    new = change["new_version"]
    assert change == {"verifier": "planted", "old_version": old["planted"], "new_version": new, "before": "1",
                      "after": "0", "completions": 2 * n_planted}
    assert new != old["planted"]
    assert report["versions"] == {f"exact_match {old['exact_match']} -> {old['exact_match']}": 2 * 4 * 8,
                                  f"planted {old['planted']} -> {new}": 2 * 4 * 8}

    # verify.rescored: every request once, its changed completions exactly the planted ones.
    records = [RescoredRequest.model_validate_json(r.value() or b"") for r in read_topic(settings, "verify.rescored")]
    assert len(records) == requests
    by_task = {r.result.task_id: r for r in records if r.result.groups is None}
    for task, completions in work:
        r = by_task[task.task_id]
        assert r.before is not None and r.changed == [i for i, c in enumerate(completions) if planted(task, c)]
        assert {v.version for v in r.result.verdicts} == {new if task.verifier == "planted" else old["exact_match"]}
    [step] = [r for r in records if r.result.groups is not None]  # its groups in order, its changes by position
    assert step.before is not None and [g.task_id for g in step.result.groups or []] == [t.task_id for t, _ in work]
    assert step.changed == [i for i, (t, c) in enumerate((t, c) for t, cs in work for c in cs) if planted(t, c)]
    assert [{v.version for v in group} for group in step.result.by_group()] == [
        {new if t.verifier == "planted" else old["exact_match"]} for t, _ in work]

    # The human report: the same figures, the versions named.
    table = await invoke("rescore", "--no-publish")
    assert table.exit_code == 0, table.output
    assert f"{2 * n_planted} changed" in table.stdout and old["planted"] in table.stdout and new in table.stdout
    # A range: offsets 0..0 of each partition, and a time after every request.
    first = json.loads((await invoke("rescore", "--from", "0", "--to", "0", "--no-publish", "--json")).stdout)
    assert 1 <= first["requests"] <= 4
    later = json.loads((await invoke("rescore", "--since", "2100-01-01", "--no-publish", "--json")).stdout)
    assert later["requests"] == 0
