"""The ``tests`` verifier's verdicts on a batch of patches, through a real exec worker on per-test topics."""

from __future__ import annotations

from pathlib import Path

from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.verifiers import VerifierContext, Verifiers
from kiln.workers.verifiers.contract import Verdict
from tests.workers.exec.conftest import exec_worker


async def judged_patches(settings: KilnSettings, lock_dir: Path, client_id: str, task: RolloutTask,
                         patches: list[str], request_id: str) -> list[Verdict]:
    """Each patch (a unified diff) judged by ``task``'s verifier, in order."""
    with exec_worker(settings, lock_dir) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, client_id) as kiln:
            verifiers = Verifiers(VerifierContext(kiln))
            verdicts = await verifiers.get(task.verifier).verify(task, [f"<patch>\n{p}</patch>" for p in patches],
                                                                 request_id)
            await verifiers.close()
    return list(verdicts)
