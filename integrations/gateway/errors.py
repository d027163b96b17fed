"""The errors of ``kiln.integrations.gateway``, under kiln's root ``KilnError``."""

from __future__ import annotations

from typing import Any

from kiln.streams.errors import KilnError


class PeerError(KilnError):
    """An exception the SWE-ReX client re-raises as ``class_path``."""

    def __init__(self, class_path: str, message: str, extra_info: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.class_path = class_path
        self.extra_info = extra_info or {}
