"""Export the JSON Schema of every boundary model, and judge whether a change stays compatible.

``python -m kiln.schemas.export`` rewrites ``schemas/jsonschema/<Model>.v<N>.json``; ``--check`` exits 1 when a model
changed incompatibly against its committed schema (a field removed, retyped or made required, an enum
narrowed). Compatible additions only need a re-export; an incompatible change needs a new schema_version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.builtin import EchoRequest, EchoResult, SleepRequest, SleepResult
from kiln.schemas.envelope import SCHEMA_VERSION, RequestEnvelope, ResultEnvelope
from kiln.schemas.exec import ExecRequest, ExecResult
from kiln.schemas.ingest import IngestEvent, IngestRequest
from kiln.schemas.lean import LeanRequest, LeanResult
from kiln.schemas.ops import StageStats, WorkerHeartbeat
from kiln.schemas.reports import CoverageReport, TestReport
from kiln.schemas.rl import PolicyUpdate, RolloutGroup, RolloutRequest
from kiln.schemas.tasks import TaskHealth
from kiln.schemas.verify import VerifyRequest, VerifyResult

SCHEMA_DIR = Path(__file__).parent / "jsonschema"
MODELS: list[type[BaseModel]] = [
    RequestEnvelope, ResultEnvelope, EchoRequest, EchoResult, SleepRequest, SleepResult, TestReport, CoverageReport,
    IngestRequest, IngestEvent, LeanRequest, LeanResult, BuildRequest, BuildEvent,
    ExecRequest, ExecResult, RolloutRequest, RolloutGroup, PolicyUpdate, WorkerHeartbeat, StageStats, VerifyRequest,
    VerifyResult, TaskHealth,
]


def schema_path(model: type[BaseModel]) -> Path:
    return SCHEMA_DIR / f"{model.__name__}.v{SCHEMA_VERSION}.json"


def current_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(mode="validation")


def _types(prop: dict[str, Any]) -> set[str]:
    """A comparable description of what values a property accepts."""
    if "anyOf" in prop:
        return set().union(*(_types(p) for p in prop["anyOf"]))
    if "$ref" in prop:
        return {"ref:" + prop["$ref"]}
    if "enum" in prop:
        return {f"enum:{v}" for v in prop["enum"]}
    if "const" in prop:
        return {f"enum:{prop['const']}"}
    return {str(prop.get("type", "any"))}


def _objects(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    objs = {"#": schema}
    objs.update({f"#/$defs/{k}": v for k, v in schema.get("$defs", {}).items()})
    return objs


def incompatible_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why a reader of ``old`` would reject or misread data written against ``new`` (empty = compatible)."""
    problems: list[str] = []
    new_objs = _objects(new)
    for where, old_obj in _objects(old).items():
        new_obj = new_objs.get(where)
        if new_obj is None:
            problems.append(f"{where}: definition removed")
            continue
        old_props, new_props = old_obj.get("properties", {}), new_obj.get("properties", {})
        for name, prop in old_props.items():
            if name not in new_props:
                problems.append(f"{where}.{name}: removed")
            elif not _types(prop) <= _types(new_props[name]) and not _types(new_props[name]) <= {"any"}:
                problems.append(f"{where}.{name}: type changed {_types(prop)} -> {_types(new_props[name])}")
        for name in set(new_obj.get("required", [])) - set(old_obj.get("required", [])):
            problems.append(f"{where}.{name}: newly required")
        if "enum" in old_obj and not set(old_obj["enum"]) <= set(new_obj.get("enum", [])):
            problems.append(f"{where}: enum narrowed")
    return problems


def main(argv: list[str]) -> int:
    check = "--check" in argv
    SCHEMA_DIR.mkdir(exist_ok=True)
    failed = False
    for model in MODELS:
        path, schema = schema_path(model), current_schema(model)
        if check:
            if not path.exists():
                print(f"{path.name}: missing, run python -m kiln.schemas.export")
                failed = True
                continue
            problems = incompatible_changes(json.loads(path.read_text()), schema)
            for p in problems:
                print(f"{model.__name__}: {p}")
            failed |= bool(problems)
        else:
            path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
