"""The errors of ``kiln.workers.exec``, under kiln's root ``KilnError``."""

from __future__ import annotations

from kiln.streams.errors import ClientError, RoutineJobError


class SessionError(RoutineJobError):
    """The request cannot apply to the session (bad path, image not allowed, ...): an answer, not a dead letter."""


class ImageUnavailable(SessionError):
    """The image cannot run here: neither the engine nor the registry has it, or a tests run finds no test command
    recorded in it. The image's failure, not the worker's: answered, never retried."""


class SessionDenied(SessionError):
    """The request's proof does not match the session (forged, altered, or a replay past the window)."""


class SessionLost(SessionError):
    """The session's container is gone (its worker died, or it expired); open a new one."""


class LimitExceeded(SessionError):
    """A requested limit is above what this deployment allows (``KILN_EXEC_MAX_*``)."""


class SealError(ClientError):
    """A sealed key that does not open with this client's key."""
