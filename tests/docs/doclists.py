"""The lists in the docs that mirror code, each compared with the code by a pure function: a function takes what the
code has (names, models, source text) and the document's text, and returns the differences as sentences (empty: in
step). ``tests/docs/test_lists.py`` calls each on the real code, and again with a temporary extra item to show it
failing. ``docs/metrics.md`` is generated: ``.venv/bin/python tests/docs/doclists.py`` writes it again.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from kiln.streams.stage import StageSpec

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("streams", "workers", "ingest", "rl", "integrations", "schemas")
METRICS_DOC = ROOT / "docs" / "metrics.md"
REGENERATE = ".venv/bin/python tests/docs/doclists.py"


def sources(packages: Iterable[str] = SOURCE_PACKAGES) -> dict[str, str]:
    """Every Python file of kiln's source packages, by path relative to the repository."""
    return {str(p.relative_to(ROOT)): p.read_text() for top in packages for p in sorted((ROOT / top).rglob("*.py"))
            if "calc-repo" not in p.parts}


def section(doc: str, heading: str) -> str:
    """The text under a heading, up to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(heading)}\n", doc, flags=re.M)
    if match is None:
        return ""
    level = len(match.group(1))
    end = re.search(rf"^#{{1,{level}}} ", doc[match.end():], flags=re.M)
    return doc[match.end():match.end() + end.start() if end else len(doc)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in ``text``, as cells (header and separator rows left out)."""
    rows: list[list[str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.match(r"^\|[-| :]+\|$", line):
            continue
        if i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            continue  # a header
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def table(text: str, first_column: str) -> list[list[str]]:
    """The body rows of the one table in ``text`` whose header's first cell is ``first_column``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return table_rows("\n".join(lines[start:end]))


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _diff(what: str, code: set[str], docs: set[str], where: str) -> list[str]:
    return ([f"{what} {n!r} is in the code but not in {where}" for n in sorted(code - docs)]
            + [f"{what} {n!r} is in {where} but not in the code" for n in sorted(docs - code)])


# Verifiers --------------------------------------------------------------------------------------------------------

VERIFIERS_HEADING = "Adding a verifier or a task source"


def registered_verifiers() -> set[str]:
    """The built-in verifiers and those of the ``kiln.verifiers`` entry points, as a worker knows them."""
    from importlib.metadata import entry_points

    from kiln.workers.verifiers.registry import BUILT_IN

    return set(BUILT_IN) | {p.name for p in entry_points(group="kiln.verifiers")}


def verifier_drift(registered: set[str], doc: str) -> list[str]:
    """The verifier table in ``doc`` (header ``| verifier |``; first cell: the name a task's ``verifier`` says) lists
    exactly the registered ones."""
    listed = {ticked(row[0])[0] for row in table(doc, "verifier") if ticked(row[0])}
    return _diff("verifier", registered, listed, "the verifier table") if listed else ["no verifier table"]


# Stages -----------------------------------------------------------------------------------------------------------

STAGES_HEADING = "Stages and topics"


@dataclass(frozen=True)
class StageRow:
    kind: str
    package: str
    topic: str
    partitions: int
    events: str | None
    keyed: bool
    forever: bool


def stage_rows(specs: Iterable[StageSpec]) -> set[StageRow]:
    """What the stage table says of each spec: kind, package directory, request topic and partitions, events."""
    rows = set()
    for spec in specs:
        module = spec.handler.split(":")[0]
        package = "/".join(module.split(".")[1:-1]) + "/"  # kiln.workers.builder.stage -> workers/builder/
        rows.add(StageRow(spec.kind, package, spec.request_topic, spec.partitions, spec.events_topic,
                          spec.ordering == "keyed", spec.retention == "forever"))
    return rows


def stage_drift(specs: Iterable[StageSpec], doc: str) -> list[str]:
    """Every registered stage (``kiln.stages``) has its row: kind, package, request topic (partitions; "kept
    forever" when its retention is), ordering ("keyed …" or not), events topic; and the table names no other stage."""
    listed: set[StageRow] = set()
    for row in table_rows(section(doc, STAGES_HEADING)):
        if len(row) < 5:
            continue
        kinds, packages = ticked(row[0]), ticked(row[1])
        topics = re.findall(r"`([\w.-]+)` \((\d+)", row[2])
        events = ticked(row[4])
        for i, kind in enumerate(kinds):
            topic, partitions = topics[i] if i < len(topics) else ("?", "0")
            listed.add(StageRow(kind, packages[0] if packages else "?", topic, int(partitions),
                                events[0] if events else None, row[3].startswith("keyed"), "kept forever" in row[2]))
    if not listed:
        return ["no stage table"]
    want = stage_rows(specs)
    missing = sorted(want - listed, key=lambda r: r.kind)
    unknown = sorted(listed - want, key=lambda r: r.kind)
    return ([f"stage {r.kind!r} ({r.package}, {r.topic} ({r.partitions}), events {r.events}, keyed {r.keyed}, "
             f"forever {r.forever}) is registered but not in the stage table as such" for r in missing]
            + [f"the stage table's row {r} matches no registered stage" for r in unknown])


def facade_drift(root: Path, doc: str) -> list[str]:
    """Each facade the stage table names (other than ``KilnClient.call``) is a class in its package's ``client.py``."""
    problems = []
    for row in table_rows(section(doc, STAGES_HEADING)):
        if len(row) < 6 or not ticked(row[1]):
            continue
        for facade in ticked(row[5]):
            client = root / ticked(row[1])[0] / "client.py"
            if facade != "KilnClient.call" and not (client.is_file() and f"class {facade}" in client.read_text()):
                problems.append(f"the stage table's facade {facade} is not a class in {client.relative_to(root)}")
    return problems


def protocol_drift(members: Iterable[str], text: str) -> list[str]:
    """A section about a protocol names each of its members (`` `name` `` or `` `name(`` …)."""
    return [f"{m!r} is a member of the protocol but not named in the docs" for m in sorted(members)
            if not re.search(rf"`(async )?{m}[`(]", text)]


def errors_drift(files: Iterable[str], doc: str) -> list[str]:
    """The typed-errors row names every package's ``errors.py`` and no other."""
    row = next((r for r in table_rows(doc) if r and "typed errors" in r[0]), None)
    if row is None:
        return ["no typed errors row"]
    named = {t for t in ticked(row[-1]) if t.endswith("/errors.py")}
    return _diff("errors module", set(files), named, "the typed errors row")


# Envelope ---------------------------------------------------------------------------------------------------------

ENVELOPE_HEADING = "The envelope"


def envelope_drift(models: Mapping[str, type[BaseModel]], doc: str) -> list[str]:
    """The envelope table has a row per field, with a column per model (``request``, ``result``) marked ✓ where
    the model has that field."""
    text = section(doc, ENVELOPE_HEADING)
    header = next((line for line in text.splitlines() if line.startswith("| field |")), None)
    if header is None:
        return ["no envelope table"]
    columns = [c.strip() for c in header.strip().strip("|").split(" | ")]
    problems = []
    for name, model in models.items():
        if name not in columns:
            problems.append(f"the envelope table has no column {name!r}")
            continue
        col = columns.index(name)
        listed = {ticked(row[0])[0] for row in table_rows(text) if ticked(row[0]) and row[col] == "✓"}
        problems += _diff(f"{name} field", set(model.model_fields), listed, "the envelope table")
    return problems


# Settings prefixes --------------------------------------------------------------------------------------------------

SETTINGS_HEADING = "Settings"


@dataclass(frozen=True)
class SettingsClass:
    module: str
    name: str
    prefix: str


def settings_classes(source: Mapping[str, str]) -> list[SettingsClass]:
    """Each class that configures settings (``model_config = SettingsConfigDict(...)``) or subclasses
    ``BaseSettings`` directly, with its ``env_prefix`` ("" when none is set)."""
    found = []
    for module, text in source.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            direct = any(isinstance(b, ast.Name) and b.id == "BaseSettings" for b in node.bases)
            config = next((s.value for s in node.body if isinstance(s, ast.Assign)
                           and any(isinstance(t, ast.Name) and t.id == "model_config" for t in s.targets)
                           and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)
                           and s.value.func.id == "SettingsConfigDict"), None)
            fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(
                s.annotation)]
            if config is None and not (direct and fields):  # a base without fields (RenamedPrefix) reads nothing
                continue
            prefix = next((k.value.value for k in (config.keywords if isinstance(config, ast.Call) else [])
                           if k.arg == "env_prefix" and isinstance(k.value, ast.Constant)), "")
            found.append(SettingsClass(module, node.name, str(prefix)))
    return found


def settings_drift(classes: Iterable[SettingsClass], stage_packages: Mapping[str, str], doc: str) -> list[str]:
    """The settings table (first cell the prefix; the second says ``stage `kind` `` for a stage's) has every prefix
    the code reads and no other; a stage's package reads one prefix, and the table gives it to that package's stage
    (``workers/builtin/`` holds two stages: it is given to one of them)."""
    classes = list(classes)
    problems = [f"{c.module} {c.name} reads settings without an env_prefix" for c in classes if not c.prefix]
    rows = {ticked(row[0])[0]: row for row in table_rows(section(doc, SETTINGS_HEADING)) if ticked(row[0])}
    if not rows:
        return ["no settings table"]
    problems += _diff("settings prefix", {c.prefix for c in classes if c.prefix}, set(rows), "the settings table")
    kinds: dict[str, list[str]] = {}
    for kind, package in sorted(stage_packages.items()):
        kinds.setdefault(package, []).append(kind)
    for package, of in sorted(kinds.items()):
        prefixes = sorted({c.prefix for c in classes if c.module.startswith(package) and c.prefix})
        if len(prefixes) > 1:
            problems.append(f"stage {of[0] if len(of) == 1 else of}'s package {package} reads {len(prefixes)} "
                            f"prefixes {prefixes}; one per stage")
        for prefix in prefixes:
            if prefix in rows and not any(f"stage `{kind}`" in rows[prefix][1] for kind in of):
                problems.append(f"the settings table does not give {prefix} to stage {' or '.join(of)}")
    return problems


# Metrics ----------------------------------------------------------------------------------------------------------

METRIC_TYPES = ("Counter", "Gauge", "Histogram", "Summary")


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    help: str
    module: str


def _string(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _type_of(call: ast.Call) -> str | None:
    name = call.func.id if isinstance(call.func, ast.Name) else (
        call.func.attr if isinstance(call.func, ast.Attribute) else None)
    # collections.Counter takes one positional argument; a Prometheus metric takes a name and its help text
    return name if name in METRIC_TYPES and len(call.args) >= 2 else None


def metrics_in_source(source: Mapping[str, str]) -> tuple[list[Metric], list[str]]:
    """The Prometheus metrics the source defines, read from its syntax: ``Counter("kiln_…", "help", …)`` and the
    other types; a local helper that passes its first parameter on as the name (``gauge("kiln_…", "help")``); an
    f-string name over a dict literal's keys (``{n: Gauge(f"kiln_x_{n}", doc) for n, doc in fields.items()}``).
    Also returns the metric definitions it could not read, so that no definition escapes the reference."""
    metrics: list[Metric] = []
    unreadable: list[str] = []
    for module, text in source.items():
        tree = ast.parse(text)
        helpers: dict[str, str] = {}
        expanded: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.args.args:
                first = fn.args.args[0].arg
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call) and (kind := _type_of(call)) and isinstance(call.args[0], ast.Name) \
                            and call.args[0].id == first:
                        helpers[fn.name] = kind
                        expanded.add(id(call))  # the helper's own call: its callers name the metrics
        dicts: dict[str, dict[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                keys = [_string(k) if k else None for k in node.value.keys]
                values = [_string(v) for v in node.value.values]
                if all(keys) and all(values):
                    dicts[node.targets[0].id] = {str(k): str(v) for k, v in zip(keys, values, strict=True)}
        for comp in ast.walk(tree):
            if not isinstance(comp, ast.DictComp | ast.ListComp | ast.SetComp) or len(comp.generators) != 1:
                continue
            gen = comp.generators[0]
            if not (isinstance(gen.iter, ast.Call) and isinstance(gen.iter.func, ast.Attribute)
                    and gen.iter.func.attr == "items" and isinstance(gen.iter.func.value, ast.Name)
                    and gen.iter.func.value.id in dicts and isinstance(gen.target, ast.Tuple)):
                continue
            names = [t.id for t in gen.target.elts if isinstance(t, ast.Name)]
            for call in ast.walk(comp):
                if isinstance(call, ast.Call) and (kind := _type_of(call)) and isinstance(call.args[0], ast.JoinedStr):
                    parts = call.args[0].values
                    if len(parts) == 2 and _string(parts[0]) is not None and isinstance(parts[1], ast.FormattedValue) \
                            and isinstance(parts[1].value, ast.Name) and parts[1].value.id == names[0]:
                        for key, doc in dicts[gen.iter.func.value.id].items():
                            help_ = doc if isinstance(call.args[1], ast.Name) and call.args[1].id == names[-1] \
                                else (_string(call.args[1]) or "")
                            metrics.append(Metric(f"{_string(parts[0])}{key}", kind, help_, module))
                        expanded.add(id(call))
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or id(call) in expanded:
                continue
            func = call.func.id if isinstance(call.func, ast.Name) else None
            kind = _type_of(call) or (helpers.get(func) if func and len(call.args) >= 2 else None)
            if kind is None:
                continue
            name = _string(call.args[0])
            if name is not None:
                metrics.append(Metric(name, kind, _string(call.args[1]) or "", module))
            else:
                unreadable.append(f"{module}:{call.lineno}")
    return sorted(metrics, key=lambda m: m.name), unreadable


def metrics_reference(metrics: Iterable[Metric]) -> str:
    """``docs/metrics.md``: every metric kiln defines, generated from the source."""
    lines = ["# Metrics", "",
             "Every Prometheus metric kiln's code defines, generated from the source by `tests/docs/doclists.py`",
             f"(`{REGENERATE}` writes it again; `tests/docs/test_lists.py` fails while it is stale). A worker's",
             "`/metrics` (`KILN_METRICS_PORT`) serves the runtime's (`streams/metrics.py`, labelled `stage` and",
             "`worker`) and its stage's own; the stats app, the status page, the autoscaler, Saucer's server, the",
             "gateway, the inference server and the trainer serve theirs; the client's are in its process's default",
             "registry. A histogram's samples are `<name>_bucket`, `<name>_sum` and `<name>_count`.", "",
             "| metric | type | help | defined in |", "|---|---|---|---|"]
    for m in metrics:
        lines.append(f"| `{m.name}` | {m.type.lower()} | {m.help.replace('|', '/')} | `{m.module}` |")
    return "\n".join(lines) + "\n"


NOT_METRICS = {"kiln_task", "kiln_failed", "kiln_failure", "kiln_wordcount", "kiln_wordlen", "kiln_verifier",
               "kiln_version", "kiln_version_id"}
"""``kiln_…`` names the docs use that are no metric: fields of the trainer adapters' rows, the toy packages."""


def documented_metric_drift(metrics: Iterable[Metric], docs: Mapping[str, str]) -> list[str]:
    """Every ``kiln_…`` name the docs present as a metric (in backticks, alone or with its labels:
    `` `kiln_dlq_total{reason}` ``; not a prefix such as ``kiln_stats_*``, nor the few in ``NOT_METRICS``) is a
    metric the code defines. (That every metric the code defines is documented: ``stale_reference``.)"""
    names = {m.name for m in metrics}
    known = names | {f"{n}{s}" for n in names for s in ("_bucket", "_sum", "_count", "_created")}
    problems = []
    for page, text in sorted(docs.items()):
        presented = set(re.findall(r"`(kiln_[a-z0-9_]*[a-z0-9])(?:\{[\w,= ]*\})?`", text))
        for name in sorted(presented - NOT_METRICS - known):
            problems.append(f"{page} presents {name} as a metric, and no code defines it")
    return problems


def stale_reference(metrics: Iterable[Metric], current: str) -> list[str]:
    want = metrics_reference(metrics)
    return [] if want == current else [f"docs/metrics.md is stale: run `{REGENERATE}`"]


def main() -> None:
    metrics, unreadable = metrics_in_source(sources(("streams", "workers", "ingest", "rl", "integrations")))
    if unreadable:
        sys.exit(f"metric definitions not read: {unreadable}")
    METRICS_DOC.write_text(metrics_reference(metrics))
    print(f"wrote {METRICS_DOC.relative_to(ROOT)}: {len(metrics)} metrics")


if __name__ == "__main__":
    main()
