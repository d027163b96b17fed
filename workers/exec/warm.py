"""The warm pool: ready containers (created, their work area populated) for recently opened images, so an ``open``
with default limits and no snapshot starts at once (``kiln_exec_sessions_opened_total{warm}``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kiln.schemas.exec import SessionLimits
from kiln.workers.exec.sessions import SessionManager

WarmEntry = tuple[Any, list[str], int, int]
"""A ready container: the container, its volumes, its keeper's and its init's host pids (``create_container``)."""


class WarmPool:
    """Up to ``per_image`` ready containers for each of the ``images`` most recently opened images (LRU)."""

    def __init__(self, manager: SessionManager, per_image: int, images: int) -> None:
        self.manager = manager
        self.per_image = per_image
        self.images = images
        self.entries: OrderedDict[str, list[WarmEntry]] = OrderedDict()
        self._opening: set[str] = set()  # containers taken from the pool, not yet adopted

    def take(self, image: str) -> WarmEntry | None:
        entries = self.entries.get(image)
        if entries:
            self.entries.move_to_end(image)
            entry = entries.pop()
            self._opening.add(entry[0].id)  # neither warm nor a session yet: the reaper must not take it
            return entry
        return None

    def adopted(self, container_id: str) -> None:
        """A container ``take`` handed out is a session now (or removed): the reaper sees it as such."""
        self._opening.discard(container_id)

    def refill(self, image: str) -> None:
        """(Blocking.) Top ``image``'s entries up, dropping the least recently used image beyond ``images``."""
        if self.per_image == 0 or self.images == 0:
            return
        self.entries.setdefault(image, [])
        self.entries.move_to_end(image)
        while len(self.entries) > self.images:
            _, dropped = self.entries.popitem(last=False)
            for container, volumes, _, _ in dropped:
                self.manager.remove(container, volumes)
        while image in self.entries and len(self.entries[image]) < self.per_image:
            container, volumes, keeper, init_pid = self.manager.create_container(image, SessionLimits())
            self.manager.populate(container, image, None, SessionLimits())
            self.entries[image].append((container, volumes, keeper, init_pid))

    def container_ids(self) -> set[str]:
        """Every container the pool holds or has handed out and not yet seen adopted."""
        return self._opening | {e[0].id for entries in self.entries.values() for e in entries}

    def close(self) -> None:
        """(Blocking.) Remove every ready container."""
        for entries in self.entries.values():
            for container, volumes, _, _ in entries:
                self.manager.remove(container, volumes)
