"""Lean workers run every REPL in bubblewrap: the sandbox is installed once per session, as `kiln setup` does."""

from __future__ import annotations

import pytest

from tests.conftest import _ensure


@pytest.fixture(scope="session", autouse=True)
def lean_sandbox() -> None:
    _ensure("lean")
