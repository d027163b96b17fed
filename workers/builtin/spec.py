"""Specs of the built-in stages: ``echo`` (returns its input) and ``sleep`` (holds a slot; fails on request)."""

from __future__ import annotations

from kiln.schemas.builtin import EchoRequest, EchoResult, SleepRequest, SleepResult
from kiln.streams.stage import StageSpec

echo = StageSpec("echo", "echo.requests", EchoRequest, EchoResult, handler="kiln.workers.builtin.echo:stage")


def _sleep_facets(result: SleepResult) -> dict[str, str | float]:
    return {"slept_s": result.slept, "attempt": str(result.attempt)}


sleep = StageSpec("sleep", "sleep.requests", SleepRequest, SleepResult, handler="kiln.workers.builtin.sleep:stage",
                  partitions=16, facets=_sleep_facets)
