"""A renamed settings variable is still read for one release, with a warning naming the new one."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pydantic_settings import SettingsConfigDict

from kiln.streams.settings import RenamedPrefix
from kiln.workers.builder.stage import BuilderSettings


class Renamed(RenamedPrefix):
    model_config = SettingsConfigDict(env_prefix="KILN_TEMP_NEW_")
    renamed_from: ClassVar[str] = "KILN_TEMP_OLD_"

    slots: int = 1
    name: str = "x"


def test_an_old_variable_is_read_with_a_warning_naming_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_TEMP_OLD_SLOTS", "7")
    with pytest.warns(DeprecationWarning, match="KILN_TEMP_OLD_SLOTS is renamed KILN_TEMP_NEW_SLOTS") as warned:
        settings = Renamed()
    assert warned[0].filename == __file__  # the code that made the settings, not pydantic's
    assert (settings.slots, settings.name) == (7, "x")


def test_the_new_variable_wins_and_nothing_warns(monkeypatch: pytest.MonkeyPatch,
                                                  recwarn: pytest.WarningsRecorder) -> None:
    monkeypatch.setenv("KILN_TEMP_OLD_SLOTS", "7")
    monkeypatch.setenv("KILN_TEMP_NEW_SLOTS", "3")
    monkeypatch.setenv("KILN_TEMP_NEW_NAME", "y")
    assert (Renamed().slots, Renamed().name) == (3, "y")
    assert [w for w in recwarn if issubclass(w.category, DeprecationWarning)] == []
    assert Renamed(slots=5).slots == 5  # arguments win over both


def test_the_build_stage_reads_one_prefix_and_its_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_BUILD_REGISTRY", "new:5000")
    assert BuilderSettings().registry == "new:5000"
    monkeypatch.delenv("KILN_BUILD_REGISTRY")
    monkeypatch.setenv("KILN_BUILDER_REGISTRY", "old:5000")
    monkeypatch.setenv("KILN_BUILDER_TEST_PIDS", "64")
    with pytest.warns(DeprecationWarning, match="KILN_BUILDER_REGISTRY is renamed KILN_BUILD_REGISTRY"):
        settings = BuilderSettings()
    assert (settings.registry, settings.test_pids) == ("old:5000", 64)
