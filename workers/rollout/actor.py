"""``kiln rl actor``: tasks from a task source become rollout requests, one per prompt group, never more than
``max_ahead`` groups beyond what the trainer has trained on (read from ``policy.updates``): the back-pressure that
bounds how stale a rollout can get."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.schemas.envelope import ResultEnvelope
from kiln.schemas.rl import RolloutRequest, Sampling
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.workers.rollout.tasks import TaskSource
from kiln.workers.rollout.train import latest_update

log = logging.getLogger("kiln.actor")


class ActorSettings(BaseSettings):
    """``KILN_ACTOR_*``."""

    model_config = SettingsConfigDict(env_prefix="KILN_ACTOR_", extra="ignore")

    client_id: str = "kiln-actor"
    max_ahead: int = Field(128, ge=1, description="Groups submitted beyond those the trainer has trained on.")
    n: int = Field(8, ge=1, le=64, description="Samples per group.")
    max_tokens: int = 3
    temperature: float = 1.0
    poll_s: float = Field(0.5, gt=0, description="How often policy.updates is read while held back.")


@dataclass
class ActorReport:
    submitted: int
    answered: int
    failed: int
    held_back_s: float
    latest_version: int


class Actor:
    def __init__(self, settings: KilnSettings, tasks: TaskSource, actor: ActorSettings | None = None) -> None:
        self.settings, self.tasks = settings, tasks
        self.config = actor or ActorSettings()
        self.stop = asyncio.Event()

    async def run(self, groups: int | None = None) -> ActorReport:
        """Submit until ``groups`` were submitted (or ``stop``), then wait for their answers."""
        c = self.config
        sampling = Sampling(n=c.n, max_tokens=c.max_tokens, temperature=c.temperature)
        report = ActorReport(submitted=0, answered=0, failed=0, held_back_s=0.0, latest_version=0)
        trained = 0
        futures: list[asyncio.Future[ResultEnvelope]] = []
        async with KilnClient(self.settings, c.client_id) as client:
            while not self.stop.is_set() and (groups is None or report.submitted < groups):
                if report.submitted - trained >= c.max_ahead:
                    update = await asyncio.to_thread(latest_update, self.settings)
                    if update is not None:
                        trained, report.latest_version = int(update["groups_total"]), int(update["version"])
                    if report.submitted - trained >= c.max_ahead:
                        report.held_back_s += c.poll_s
                        await asyncio.sleep(c.poll_s)
                        continue
                task = self.tasks.sample(1)[0]
                futures.append(await client.submit("rollout", RolloutRequest(
                    task=task, sampling=sampling, actor_version=report.latest_version)))
                report.submitted += 1
            for outcome in await asyncio.gather(*futures, return_exceptions=True):
                if isinstance(outcome, ResultEnvelope) and outcome.status == "ok":
                    report.answered += 1
                else:
                    report.failed += 1
        log.info("actor: %s", report)
        return report
