"""Prometheus rules and the Grafana dashboard: promtool checks and unit-tests the rules; every expression in them
and in the dashboard refers only to metrics kiln exports (or that the rules record), and parses as PromQL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kiln.schemas.ops import StageStats
from kiln.streams.errors import ConfigError
from kiln.streams.metrics import WorkerMetrics
from kiln.streams.stage import load_stage, stage_specs
from kiln.streams.stats.app import StatsApp

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "infra" / "prometheus"
DASHBOARD = ROOT / "infra" / "grafana" / "dashboards" / "kiln.json"
KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}


def _names(registry: CollectorRegistry) -> set[str]:
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES.get(family.type, ("",))}


def exported_metrics() -> set[str]:
    """Every metric name a kiln process serves: the runtime's, each stage's own registry, the stats stream's."""
    names = _names(WorkerMetrics("any", "any").registry)
    for kind in stage_specs():
        try:
            stage = load_stage(kind)
        except ConfigError as e:
            if "torch" in str(e):
                continue  # the rl extra is not installed (KILN_RL=0): its stage cannot be loaded
            raise
        if stage.registry is not None:
            names |= _names(stage.registry)
    every_field = StageStats(stage="s", at=0, window_s=60, queue_length=1, completions_per_min=1,
                             failures_per_min={"E": 1}, workers_avg=1, slots_avg=1, busy_avg=1, workers_now=1,
                             slots_now=1, busy_now=1, completions_total=1, job_seconds_p50=1, job_seconds_p99=1,
                             facets_per_min={"f": {"v": 1}}, values={"v": 1}, gauges={"g": 1})
    text = StatsApp.render_metrics(SimpleNamespace(latest={"s": every_field}))  # type: ignore[arg-type]
    names |= {line.split()[2] for line in text.decode().splitlines() if line.startswith("# TYPE")}
    return names


def recorded_metrics() -> set[str]:
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    return {r["record"] for group in rules["groups"] for r in group["rules"] if "record" in r}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: not functions, keywords, label names or label values."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    found = set()
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", bare):
        name, call = match.group(1), match.group(2)
        if call or name in KEYWORDS:
            continue
        found.add(name)
    return found


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def _rule_exprs() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    return [r["expr"] for group in rules["groups"] for r in group["rules"]]


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool missing: run `kiln setup ops`")
    return found


def test_rules_pass_promtool(promtool: str) -> None:
    subprocess.run([promtool, "check", "rules", "rules.yml"], cwd=PROMETHEUS, check=True, capture_output=True)
    tested = subprocess.run([promtool, "test", "rules", "rules.test.yml"], cwd=PROMETHEUS, capture_output=True,
                            text=True, check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=PROMETHEUS, check=True, capture_output=True)


def test_promtool_catches_a_wrong_expectation(promtool: str, tmp_path: Path) -> None:
    """The unit tests can fail: the same file with one expected value changed does."""
    (tmp_path / "rules.yml").write_text((PROMETHEUS / "rules.yml").read_text())
    wrong = (PROMETHEUS / "rules.test.yml").read_text().replace("value: 0.7", "value: 0.6")
    (tmp_path / "rules.test.yml").write_text(wrong)
    tested = subprocess.run([promtool, "test", "rules", "rules.test.yml"], cwd=tmp_path, capture_output=True,
                            text=True, check=False)
    assert tested.returncode != 0 and "build_failure_ratio" in tested.stdout + tested.stderr


def test_every_expression_reads_only_kiln_metrics() -> None:
    known = exported_metrics() | recorded_metrics()
    assert {"kiln_stats_queue_length", "kiln_lean_repl_retired_total", "kiln_completions_total"} <= known
    for expr in _rule_exprs() + _dashboard_exprs():
        names = metric_names(expr)
        assert names, f"{expr!r} reads no metric"
        assert names <= known, f"{expr!r} reads {sorted(names - known)}, which kiln does not export"


def test_metric_name_extraction() -> None:
    assert metric_names('sum by (value) (kiln_stats_facet_per_min{stage="build", value!="built"})') == {
        "kiln_stats_facet_per_min"}
    assert metric_names("kiln:a / clamp_min(kiln_b[5m], 0.001) and kiln_c > 0") == {"kiln:a", "kiln_b", "kiln_c"}
    assert metric_names("rate(up[5m])") == {"up"}


def test_dashboard_expressions_parse(promtool: str, tmp_path: Path) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 15
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    (tmp_path / "dashboard-rules.yml").write_text(yaml.safe_dump(rules))
    checked = subprocess.run([promtool, "check", "rules", str(tmp_path / "dashboard-rules.yml")],
                             capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
