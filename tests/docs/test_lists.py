"""The docs' lists that mirror code agree with the code: verifiers, stages, envelope fields, settings prefixes and
metrics. Each check is shown failing with a temporary extra item (and, where it matters, one taken away)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from kiln.schemas.envelope import RequestEnvelope, ResultEnvelope
from kiln.streams.stage import StageSpec, stage_specs
from tests.docs import doclists as d

ROOT = d.ROOT
DOC = (ROOT / "docs" / "architecture.md").read_text()
ENVELOPES: dict[str, type[BaseModel]] = {"request": RequestEnvelope, "result": ResultEnvelope}
CODE = ("streams", "workers", "ingest", "rl", "integrations")


def docs() -> dict[str, str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "infra" / "k8s" / "README.md"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in pages}


def stage_packages() -> dict[str, str]:
    return {r.kind: r.package for r in d.stage_rows(stage_specs().values())}


# verifiers

def test_the_verifier_tables_are_the_registry() -> None:
    """docs/architecture.md's table (with each module) and docs/rl.md's (with each reward's cost)."""
    assert len(d.registered_verifiers()) >= 7
    assert d.verifier_drift(d.registered_verifiers(), d.section(DOC, d.VERIFIERS_HEADING)) == []
    assert d.verifier_drift(d.registered_verifiers(), (ROOT / "docs" / "rl.md").read_text()) == []


def test_a_verifier_registered_without_the_docs_fails_the_check() -> None:
    registered = d.registered_verifiers()
    assert d.verifier_drift(registered | {"temp_verifier"}, d.section(DOC, d.VERIFIERS_HEADING)) == [
        "verifier 'temp_verifier' is in the code but not in the verifier table"]
    assert d.verifier_drift(registered - {"lean_code"}, (ROOT / "docs" / "rl.md").read_text()) == [
        "verifier 'lean_code' is in the verifier table but not in the code"]


def docstring_verifiers(doc: str) -> set[str]:
    """The built-ins ``kiln.workers.verifiers``' docstring lists: ``- ``a`` and ``b`` (``module``): …`` lines."""
    return {name for line in doc.splitlines() if line.startswith("- ``")
            for name in re.findall(r"``(\w+)``", line.split("(")[0])}


def test_the_verifiers_package_docstring_lists_the_built_ins() -> None:
    import kiln.workers.verifiers as verifiers
    from kiln.workers.verifiers.registry import BUILT_IN

    assert docstring_verifiers(verifiers.__doc__ or "") == set(BUILT_IN)
    assert docstring_verifiers("- ``a`` and ``b`` (``m``): x\n- ``c`` (``n``): y") == {"a", "b", "c"}


# stages

def test_the_stage_table_is_the_registered_stages() -> None:
    assert len(stage_specs()) >= 8
    assert d.stage_drift(stage_specs().values(), DOC) == []


def test_a_stage_registered_without_the_docs_fails_the_check() -> None:
    specs = stage_specs()
    temp = StageSpec("temp", "temp.requests", BaseModel, BaseModel, handler="kiln.workers.temp.stage:stage")
    assert d.stage_drift([*specs.values(), temp], DOC) == [
        "stage 'temp' (workers/temp/, temp.requests (8), events None, keyed False, forever False) is registered but "
        "not in the stage table as such"]
    moved = StageSpec("exec", "exec.requests", BaseModel, BaseModel, handler="kiln.workers.exec.stage:stage",
                      partitions=64)
    assert len(d.stage_drift([*(s for k, s in specs.items() if k != "exec"), moved], DOC)) == 2
    assert d.stage_drift([s for k, s in specs.items() if k != "verify"], DOC) != []
    unkeyed = StageSpec("exec", "exec.requests", BaseModel, BaseModel, handler="kiln.workers.exec.stage:stage",
                        partitions=32)
    assert len(d.stage_drift([*(s for k, s in specs.items() if k != "exec"), unkeyed], DOC)) == 2


def test_every_facade_the_stage_table_names_is_its_packages_client() -> None:
    assert d.facade_drift(ROOT, DOC) == []
    renamed = DOC.replace("| `ExecClient` |", "| `TempClient` |")
    assert d.facade_drift(ROOT, renamed) == ["the stage table's facade TempClient is not a class in "
                                             "workers/exec/client.py"]


# inference endpoints and errors files

def endpoint_members() -> set[str]:
    from kiln.workers.inference.endpoints import InferenceEndpoint

    return {n for n in vars(InferenceEndpoint) if not n.startswith("_")} | set(InferenceEndpoint.__annotations__)


def test_the_inference_endpoint_section_names_the_protocol() -> None:
    assert endpoint_members() == {"url", "packs", "generate", "init_process_group", "request_weight_update", "health"}
    assert d.protocol_drift(endpoint_members(), d.section(DOC, "Adding an inference endpoint")) == []
    assert d.protocol_drift(endpoint_members() | {"temp_method"}, d.section(DOC, "Adding an inference endpoint")) == [
        "'temp_method' is a member of the protocol but not named in the docs"]


def errors_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for top in CODE for p in (ROOT / top).rglob("errors.py")}


def test_the_typed_errors_row_names_every_errors_module() -> None:
    assert d.errors_drift(errors_files(), DOC) == []
    assert d.errors_drift(errors_files() | {"rl/errors.py"}, DOC) == [
        "errors module 'rl/errors.py' is in the code but not in the typed errors row"]


# envelope

def test_the_envelope_table_is_the_envelope_models() -> None:
    assert d.envelope_drift(ENVELOPES, DOC) == []


def test_an_envelope_field_added_without_the_docs_fails_the_check() -> None:
    class Wider(RequestEnvelope):
        temp_field: int = 0

    assert d.envelope_drift({**ENVELOPES, "request": Wider}, DOC) == [
        "request field 'temp_field' is in the code but not in the envelope table"]

    class Narrower(BaseModel):
        request_id: str

    assert "result field 'status' is in the envelope table but not in the code" in d.envelope_drift(
        {**ENVELOPES, "result": Narrower}, DOC)


# settings prefixes

def test_the_settings_table_is_every_prefix_and_one_per_stage() -> None:
    classes = d.settings_classes(d.sources(CODE))
    assert len(classes) >= 15
    assert d.settings_drift(classes, stage_packages(), DOC) == []


def test_a_settings_prefix_added_without_the_docs_fails_the_check() -> None:
    temp = d.settings_classes({"workers/builder/temp.py": (
        "class TempSettings(BaseSettings):\n    model_config = SettingsConfigDict(env_prefix='KILN_TEMP_')\n")})
    assert temp == [d.SettingsClass("workers/builder/temp.py", "TempSettings", "KILN_TEMP_")]
    problems = d.settings_drift([*d.settings_classes(d.sources(CODE)), *temp], stage_packages(), DOC)
    assert problems == ["settings prefix 'KILN_TEMP_' is in the code but not in the settings table",
                        "stage build's package workers/builder/ reads 2 prefixes ['KILN_BUILD_', 'KILN_TEMP_']; "
                        "one per stage"]
    without_demo = [c for c in d.settings_classes(d.sources(CODE)) if c.prefix != "KILN_DEMO_"]
    assert d.settings_drift(without_demo, stage_packages(), DOC) == [
        "settings prefix 'KILN_DEMO_' is in the settings table but not in the code"]
    bare = d.settings_classes({"workers/x.py": "class X(BaseSettings):\n    a: int = 0\n"})
    assert d.settings_drift(bare, {}, DOC)[0] == "workers/x.py X reads settings without an env_prefix"


def test_every_settings_prefix_a_page_names_is_read() -> None:
    """A page's `` `KILN_X_*` `` names a prefix some settings class reads (a renamed one would leave it pointing at
    nothing)."""
    prefixes = {c.prefix for c in d.settings_classes(d.sources(CODE))}
    named = {(page, p) for page, text in docs().items() for p in re.findall(r"`(KILN_[A-Z_]*_)\*`", text)}
    assert len(named) >= 6
    assert sorted((page, p) for page, p in named if p not in prefixes) == []
    assert "KILN_BUILDER_" not in prefixes


# metrics

def code_metrics() -> list[d.Metric]:
    metrics, unreadable = d.metrics_in_source(d.sources(CODE))
    assert unreadable == []
    return metrics


def test_every_metric_is_in_the_generated_reference() -> None:
    metrics = code_metrics()
    assert len(metrics) > 80
    assert d.stale_reference(metrics, d.METRICS_DOC.read_text()) == [], d.REGENERATE


def test_every_metric_the_docs_name_exists() -> None:
    assert d.documented_metric_drift(code_metrics(), docs()) == []


def test_a_metric_added_or_removed_without_the_docs_fails_the_checks() -> None:
    source = ('from prometheus_client import CollectorRegistry, Counter\nregistry = CollectorRegistry()\n'
              'TEMP = Counter("kiln_temp_total", "A temporary metric.", ["why"], registry=registry)\n')
    temp, unreadable = d.metrics_in_source({"workers/temp.py": source})
    assert temp == [d.Metric("kiln_temp_total", "Counter", "A temporary metric.", "workers/temp.py")] and not unreadable
    metrics = code_metrics()
    assert d.stale_reference([*metrics, *temp], d.METRICS_DOC.read_text()) == [
        f"docs/metrics.md is stale: run `{d.REGENERATE}`"]
    # removed from the code while a page still names it
    gone = [m for m in metrics if m.name != "kiln_exec_sessions"]
    assert d.documented_metric_drift(gone, docs()) == [
        "docs/exec.md presents kiln_exec_sessions as a metric, and no code defines it",
        "docs/metrics.md presents kiln_exec_sessions as a metric, and no code defines it"]
    assert d.documented_metric_drift(metrics, {"page.md": "watch `kiln_temp_total{why}`"}) == [
        "page.md presents kiln_temp_total as a metric, and no code defines it"]


def test_the_alert_rules_and_the_dashboard_query_metrics_that_exist() -> None:
    """Not docs, but the same drift: a rule or a panel over a renamed metric silently shows nothing."""
    names = re.compile(r"kiln_[a-z0-9_]*[a-z0-9](?![a-z0-9_])")  # not a prefix such as kiln_stats_
    queries = {str(p.relative_to(ROOT)): "`" + "` `".join(names.findall(p.read_text())) + "`"
               for p in (ROOT / "infra/prometheus/rules.yml", ROOT / "infra/prometheus/rules.test.yml",
                         ROOT / "infra/grafana/dashboards/kiln.json")}
    assert all(len(q) > 10 for q in queries.values())
    assert d.documented_metric_drift(code_metrics(), queries) == []
    assert d.documented_metric_drift(code_metrics(), {"rules.yml": "`kiln_stats_temp`"}) != []


@pytest.mark.parametrize("source", [
    'def gauge(name, doc):\n    return Gauge(name, doc, ["stage"])\nA = gauge("kiln_temp_level", "Level.")\n',
    'fields = {"a": "A."}\nG = {n: Gauge(f"kiln_temp_{n}", doc, ["stage"]) for n, doc in fields.items()}\n'])
def test_metrics_behind_a_helper_or_an_fstring_are_read(source: str) -> None:
    metrics, unreadable = d.metrics_in_source({"m.py": source})
    assert [m.name for m in metrics] in (["kiln_temp_level"], ["kiln_temp_a"]) and unreadable == []


def test_a_metric_named_in_a_way_the_reader_cannot_follow_fails() -> None:
    assert d.metrics_in_source({"m.py": 'N = "kiln_x"\nC = Counter(N, "help")\n'}) == ([], ["m.py:2"])


def test_the_reference_is_linked() -> None:
    assert "(metrics.md)" in DOC and Path(d.METRICS_DOC).is_file()
