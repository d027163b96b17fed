"""Test folders that leave files out of collection (an optional extra missing) say so: each registers here, and the
root conftest prints the list under "collected N items" and in the summary, so a folder never vanishes silently."""

from __future__ import annotations

import importlib.util
from pathlib import Path

NOT_COLLECTED: dict[str, str] = {}


def unless_importable(conftest: str, module: str, pattern: str, reason: str) -> list[str]:
    """``collect_ignore_glob`` for a folder's conftest: ``[pattern]`` (registered with ``reason``) when ``module``
    cannot be imported, else nothing."""
    if importlib.util.find_spec(module) is not None:
        return []
    folder = Path(conftest).resolve().parent
    NOT_COLLECTED[f"{folder.relative_to(Path(__file__).resolve().parents[1])}/{pattern}"] = reason
    return [pattern]


def summary() -> list[str]:
    return [f"not collected: {where} ({why})" for where, why in sorted(NOT_COLLECTED.items())]
