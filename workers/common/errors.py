"""The errors of ``kiln.workers.common``, under kiln's root ``KilnError``."""

from __future__ import annotations

from kiln.streams.errors import KilnError


class ReportError(KilnError):
    """A test or coverage report does not parse."""


class NoHealthyTasks(KilnError):
    """Every task of a task source is quarantined (``kiln tasks health``): there is nothing left to serve."""
