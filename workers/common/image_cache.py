"""Images by registry reference on any node: a session on ``registry/name@sha256:...`` pulls it if this engine
lacks it, and the images this worker pulled are evicted least-recently-used beyond a bound (one in use by a
container stays: the engine refuses to remove it, and it is tried again at the next eviction)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from kiln.workers.common.registry import Registry

log = logging.getLogger("kiln.images")


class ImageCache:
    def __init__(self, client: Any, registry: Registry | None, max_pulled: int) -> None:
        self.client = client
        self.registry = registry
        self.max_pulled = max_pulled
        self.pulled: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def from_registry(self, image: str) -> bool:
        return self.registry is not None and image.startswith(f"{self.registry.address}/")

    def ensure(self, image: str) -> None:
        """Make ``image`` local (pulling it from the registry when it is a registry reference), mark it used."""
        import docker.errors

        with self._lock:
            if image in self.pulled:
                self.pulled.move_to_end(image)
        try:
            self.client.images.get(image)
            return
        except docker.errors.ImageNotFound:
            if not self.from_registry(image):
                raise
        assert self.registry is not None
        log.info("pulling %s", image)
        self.client.images.pull(image, auth_config=self.registry.docker_auth())
        with self._lock:
            self.pulled[image] = None
            self.pulled.move_to_end(image)
        self.evict()

    def evict(self) -> list[str]:
        """Remove the least recently used pulled images beyond the bound; returns what was removed."""
        import docker.errors

        removed = []
        with self._lock:
            candidates = list(self.pulled)[: max(0, len(self.pulled) - self.max_pulled)]
        for image in candidates:
            try:
                self.client.images.remove(image)
            except docker.errors.APIError as e:  # in use by a container (or gone): kept in the list, retried later
                if isinstance(e, docker.errors.ImageNotFound):
                    with self._lock:
                        self.pulled.pop(image, None)
                continue
            with self._lock:
                self.pulled.pop(image, None)
            removed.append(image)
        return removed
