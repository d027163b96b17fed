"""The setup steps' machine-wide lock: two checkouts set up side by side never run one step at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kiln.streams import infra


def test_a_step_run_from_two_checkouts_at_once_runs_one_at_a_time(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    scripts = tmp_path / "infra"
    (scripts / "probe").mkdir(parents=True)
    (scripts / "lib.sh").write_text("")
    # The step notes when it starts and ends; a second copy started while the first runs would interleave them.
    trace = tmp_path / "trace"
    (scripts / "probe" / "probe.sh").write_text(f"echo start >>{trace}; sleep 1; echo end >>{trace}\n")
    monkeypatch.setenv("KILN_INFRA_DIR", str(scripts))
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    step = infra.Step("probe", "probe/probe.sh", ())
    setups = [threading.Thread(target=infra.run_steps, args=([step],)) for _ in range(2)]
    for setup in setups:
        setup.start()
    for setup in setups:
        setup.join(30)
    assert trace.read_text().split() == ["start", "end", "start", "end"]
    assert list((tmp_path / "cache").glob("setup-probe-probe-sh.lock"))
