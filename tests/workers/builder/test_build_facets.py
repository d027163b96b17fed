"""What the stats stream counts of a build event: outcome per build system (the status page's "builds failing by
system and class")."""

from __future__ import annotations

from kiln.schemas.builder import BuildEvent
from kiln.workers.builder.spec import build


def test_facets_name_system_and_failure_class() -> None:
    assert build.facets is not None
    failed = BuildEvent(repository="r", revision="main", rules_version=1, status="failed", system="cargo",
                        failure="compile_failed")
    built = BuildEvent(repository="r", revision="main", rules_version=1, status="built", system="python")
    unmatched = BuildEvent(repository="r", revision="main", rules_version=1, status="failed",
                           failure="no_rule_matched")
    assert build.facets(failed) == {"system": "cargo", "outcome": "compile_failed",
                                    "system/outcome": "cargo/compile_failed"}
    assert build.facets(built)["system/outcome"] == "python/built"
    assert build.facets(unmatched)["system/outcome"] == "none/no_rule_matched"
