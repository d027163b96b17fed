"""``kiln rl actor``: tasks from a task source become rollout requests, one per prompt group, never more than
``max_ahead`` groups beyond what the trainer has trained on (followed on ``policy.updates``): the back-pressure that
bounds how stale a rollout can get.

``sync`` is the conventional loop, for comparison in the same code: submit ``max_ahead`` groups (one step's worth),
wait until the trainer has trained on all of them and published the new version, repeat — every sample comes from
the latest policy and generation never overlaps training.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.rl.tasks import TaskSource
from kiln.rl.train import UPDATES
from kiln.schemas.envelope import ResultEnvelope
from kiln.schemas.rl import RolloutRequest, Sampling
from kiln.streams import admin
from kiln.streams.client import KilnClient
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import WEEK, TopicSpec

log = logging.getLogger("kiln.actor")


class ActorSettings(BaseSettings):
    """``KILN_ACTOR_*``."""

    model_config = SettingsConfigDict(env_prefix="KILN_ACTOR_", extra="ignore")

    client_id: str = "kiln-actor"
    max_ahead: int = Field(128, ge=1, description="Groups submitted beyond those the trainer has trained on.")
    n: int = Field(8, ge=1, le=64, description="Samples per group.")
    max_tokens: int = 3
    temperature: float = 1.0
    sync: bool = Field(False, description="The conventional loop: a step's groups, then wait for their update.")
    seed: int | None = Field(None, ge=0, description="Seeds every group's sampling (``group_seed``); None: unseeded.")


def group_seed(run_seed: int, index: int) -> int:
    """The sampling seed of a run's ``index``-th group: its samples draw with this seed plus their index (fewer
    than 64 each), so every group of every run samples from its own generators whatever server or batch it lands in."""
    return (run_seed << 32) + index * 64


@dataclass
class ActorReport:
    submitted: int
    answered: int
    failed: int
    held_back_s: float
    latest_version: int


class UpdateFollower:
    """Follows ``policy.updates`` from its newest event on, in a thread: ``latest`` is the newest event seen and
    ``changed`` is set on each (the actor reacts to a new version at once instead of polling)."""

    def __init__(self, settings: KilnSettings, loop: asyncio.AbstractEventLoop) -> None:
        admin.create_topics(settings, [TopicSpec(UPDATES, 1, WEEK)])
        self.latest: dict[str, Any] = {}
        self.changed = asyncio.Event()
        self._loop = loop
        self._consumer = Consumer(settings.kafka(**{"group.id": f"kiln-follow-{time.monotonic_ns()}",
                                                    "enable.auto.commit": False}))
        tp = TopicPartition(settings.topic(UPDATES), 0)
        _low, high = self._consumer.get_watermark_offsets(tp, timeout=30)
        self._consumer.assign([TopicPartition(tp.topic, 0, max(high - 1, 0))])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="policy-updates", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.2)
            if msg is None or msg.error() is not None:
                continue
            event = json.loads(msg.value() or b"{}")
            self._loop.call_soon_threadsafe(self._publish, event)
        self._consumer.close()

    def _publish(self, event: dict[str, Any]) -> None:
        self.latest = event
        self.changed.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


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
        follower = await asyncio.to_thread(UpdateFollower, self.settings, asyncio.get_running_loop())
        futures: list[asyncio.Future[ResultEnvelope]] = []
        batch_left = 0  # sync: groups of the current step still to submit
        try:
            async with KilnClient(self.settings, c.client_id) as client:
                while not self.stop.is_set() and (groups is None or report.submitted < groups):
                    trained = int(follower.latest.get("groups_total", 0))
                    report.latest_version = int(follower.latest.get("version", 0))
                    if c.sync and batch_left == 0 and trained >= report.submitted:
                        batch_left = c.max_ahead
                    blocked = batch_left == 0 if c.sync else report.submitted - trained >= c.max_ahead
                    if blocked:
                        follower.changed.clear()
                        waited = time.monotonic()
                        stopping = asyncio.ensure_future(self.stop.wait())
                        await asyncio.wait([asyncio.ensure_future(follower.changed.wait()), stopping],
                                           timeout=5, return_when=asyncio.FIRST_COMPLETED)
                        stopping.cancel()
                        report.held_back_s += time.monotonic() - waited
                        continue
                    task = self.tasks.sample(1)[0]
                    seed = None if c.seed is None else group_seed(c.seed, report.submitted)
                    futures.append(await client.submit("rollout", RolloutRequest(
                        task=task, sampling=sampling.model_copy(update={"seed": seed}),
                        actor_version=report.latest_version)))
                    report.submitted += 1
                    batch_left = max(batch_left - 1, 0)
                for outcome in await asyncio.gather(*futures, return_exceptions=True):
                    if isinstance(outcome, ResultEnvelope) and outcome.status == "ok":
                        report.answered += 1
                    else:
                        report.failed += 1
        finally:
            follower.close()
        log.info("actor: %s", report)
        return report
