"""The autoscaler's loop: each tick, per stage, the stats stream's numbers -> ``decide`` -> the backend, and one
JSON line in the decision log with everything the decision was computed from."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from kiln.schemas.ops import StageStats
from kiln.streams.autoscale.backends import Backend, KedaBackend
from kiln.streams.autoscale.decide import Decision, Inputs, Policy, decide

log = logging.getLogger("kiln.autoscale")


class Autoscaler:
    def __init__(self, stages: list[str], policy: Policy, backend: Backend, stats_url: str,
                 decision_log: Path | None = None, slots_of: dict[str, int] | None = None) -> None:
        """``slots_of``: stages whose workers bring another slot count than ``policy.slots_per_worker``."""
        self.stages = stages
        self.policies = {s: policy.model_copy(update={"slots_per_worker": (slots_of or {}).get(
            s, policy.slots_per_worker)}) for s in stages}
        self.backend = backend
        self.stats_url = stats_url.rstrip("/")
        self.decision_log = decision_log
        self.latest: dict[str, Decision] = {}
        self._streak: dict[str, int] = {}
        self._http = httpx.Client(timeout=10)
        self.registry = CollectorRegistry()
        self._desired = Gauge("kiln_autoscale_desired_workers", "Workers the last tick chose.", ["stage"],
                              registry=self.registry)
        self._lq = Gauge("kiln_autoscale_queue_length", "Lq at the last tick.", ["stage"], registry=self.registry)
        self._ticks = Gauge("kiln_autoscale_last_tick_timestamp", "Unix time of the last tick.",
                            registry=self.registry)

    def stats(self, stage: str) -> StageStats | None:
        try:
            response = self._http.get(f"{self.stats_url}/stats/{stage}")
            return StageStats.model_validate_json(response.content) if response.status_code == 200 else None
        except (httpx.HTTPError, ValidationError) as e:
            log.warning("no stats for %s: %r", stage, e)
            return None

    def tick(self) -> list[dict[str, Any]]:
        entries = []
        for stage in self.stages:
            numbers = self.stats(stage)
            if isinstance(self.backend, KedaBackend) and numbers is not None:
                self.backend.seen[stage] = numbers.workers_now
            inputs = Inputs(queue_length=numbers.queue_length if numbers else None,
                            completions_per_min=numbers.completions_per_min if numbers else 0.0,
                            workers_avg=numbers.workers_avg if numbers else 0.0,
                            slots_avg=numbers.slots_avg if numbers else 0.0,
                            busy_now=numbers.busy_now if numbers else 0,
                            current=self.backend.current(stage), down_streak=self._streak.get(stage, 0))
            decision = decide(inputs, self.policies[stage])
            self.backend.scale(stage, decision.chosen)
            self._streak[stage] = decision.down_streak
            self.latest[stage] = decision
            self._desired.labels(stage=stage).set(decision.chosen)
            if inputs.queue_length is not None:
                self._lq.labels(stage=stage).set(inputs.queue_length)
            entry = {"at": time.time(), "stage": stage, "inputs": inputs.model_dump(),
                     "decision": decision.model_dump(), "policy": self.policies[stage].model_dump()}
            log.info("%s: Lq=%s Rmin=%.1f Bmin=%.2f busy=%d current=%d -> %s (%s)", stage,
                     inputs.queue_length, inputs.completions_per_min, inputs.workers_avg, inputs.busy_now,
                     inputs.current, decision.chosen, decision.branch)
            if self.decision_log is not None:
                with self.decision_log.open("a") as f:
                    f.write(json.dumps(entry) + "\n")
            entries.append(entry)
        self._ticks.set(time.time())
        return entries

    def run(self, tick_s: float, stop: threading.Event) -> None:
        """Tick every ``tick_s`` until ``stop`` is set; then the backend stops what it started."""
        try:
            while not stop.is_set():
                started = time.monotonic()
                self.tick()
                stop.wait(max(0.0, tick_s - (time.monotonic() - started)))
        finally:
            self.backend.close()

    @staticmethod
    def audit(entries: list[dict[str, Any]]) -> list[str]:
        """What in a decision log does not follow from its own inputs: each decision recomputed from its logged
        inputs and policy, and each tick's down streak carried from the stage's previous tick."""
        problems = []
        previous: dict[str, Decision] = {}
        for i, entry in enumerate(entries):
            inputs, policy = Inputs.model_validate(entry["inputs"]), Policy.model_validate(entry["policy"])
            logged, again = Decision.model_validate(entry["decision"]), decide(inputs, policy)
            if logged != again:
                problems.append(f"tick {i} ({entry['stage']}): logged {logged}, recomputed {again}")
            before = previous.get(entry["stage"])
            if inputs.down_streak != (before.down_streak if before else 0):
                problems.append(f"tick {i} ({entry['stage']}): streak {inputs.down_streak} not carried over")
            previous[entry["stage"]] = logged
        return problems

    # ---- HTTP: /keda/<stage>, /metrics, /healthz ------------------------------------------------------------

    def keda(self, path: str) -> tuple[int, str, bytes]:
        stage = path.removeprefix("/keda/").strip("/")
        if stage not in self.latest:
            return 404, "application/json", json.dumps({"error": f"no decision for {stage!r} yet"}).encode()
        decision = self.latest[stage]
        return 200, "application/json", json.dumps({"stage": stage, "desired": decision.chosen,
                                                    "branch": decision.branch}).encode()

    def metrics(self, _path: str) -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
