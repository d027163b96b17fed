"""``echo``: returns the request's data unchanged."""

from __future__ import annotations

from kiln.schemas.builtin import EchoRequest, EchoResult
from kiln.streams.stage import JobContext, Stage
from kiln.workers.builtin import spec


async def handle(request: EchoRequest, ctx: JobContext) -> EchoResult:
    del ctx
    return EchoResult(data=request.data)


stage = Stage(spec.echo, handle)
