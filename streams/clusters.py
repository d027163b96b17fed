"""Moving traffic between clusters with a configuration change only (Harmonic's REPL service moved hundreds of
thousands of CPUs between regions this way): a client over an ordered list of Kafka clusters. New requests go to the
first cluster not marked ``draining``; results are read from every listed cluster, so the jobs still in flight on a
draining one are delivered — by the futures of this process, or through ``unclaimed()`` when an earlier process with
the same client id submitted them. Each cluster has its own ``KilnClient`` (same client id), whose committed offsets
make every result delivered once across restarts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from kiln.schemas.envelope import ResultEnvelope
from kiln.streams.client import KilnClient
from kiln.streams.errors import ConfigError
from kiln.streams.settings import Cluster, KilnSettings, get_settings


class ClusterClient:
    def __init__(self, settings: KilnSettings | None = None, client_id: str | None = None, *,
                 clusters: list[Cluster] | None = None, **client_options: Any) -> None:
        self.settings = settings or get_settings()
        chosen = clusters or self.settings.clusters or [Cluster(name="default",
                                                                bootstrap_servers=self.settings.bootstrap_servers)]
        if len({c.name for c in chosen}) != len(chosen):
            raise ConfigError(f"cluster names repeat: {[c.name for c in chosen]}")
        self.order = [c.name for c in chosen]
        self.draining = {c.name for c in chosen if c.draining}
        self.clients = {c.name: KilnClient(self.settings.model_copy(update={
            "bootstrap_servers": c.bootstrap_servers, "kafka_config": {**self.settings.kafka_config,
                                                                       **c.kafka_config}}), client_id,
            **client_options) for c in chosen}

    @property
    def active(self) -> str:
        """The cluster new requests go to."""
        for name in self.order:
            if name not in self.draining:
                return name
        raise ConfigError(f"every cluster is draining ({', '.join(self.order)}): nowhere to send new requests")

    async def __aenter__(self) -> ClusterClient:
        # Every cluster's results are read from the start: a draining cluster still owes in-flight results.
        await asyncio.gather(*(c._ready() for c in self.clients.values()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    async def submit(self, kind: str, payload: BaseModel | dict[str, Any], **kwargs: Any
                     ) -> asyncio.Future[ResultEnvelope]:
        return await self.clients[self.active].submit(kind, payload, **kwargs)

    async def call(self, kind: str, payload: BaseModel | dict[str, Any], **kwargs: Any) -> Any:
        return await self.clients[self.active].call(kind, payload, **kwargs)

    def drain(self, name: str) -> None:
        """Send no new requests to ``name`` from now on (its in-flight ones are still awaited and delivered)."""
        if name not in self.clients:
            raise ConfigError(f"no cluster {name!r}; configured: {', '.join(self.order)}")
        self.draining.add(name)

    async def drained(self, name: str) -> None:
        """Until every request this process sent to ``name`` has its result."""
        await self.clients[name].settled()

    async def unclaimed(self) -> AsyncIterator[ResultEnvelope]:
        """Results from any cluster for requests this process did not submit (an earlier life's)."""
        merged: asyncio.Queue[ResultEnvelope] = asyncio.Queue()

        async def pump(client: KilnClient) -> None:
            async for envelope in client.unclaimed():
                await merged.put(envelope)

        tasks = [asyncio.create_task(pump(c)) for c in self.clients.values()]
        try:
            while True:
                yield await merged.get()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
