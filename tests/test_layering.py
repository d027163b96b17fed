"""The dependency direction of docs/architecture.md, checked on every import in the package: schemas imports nothing
of kiln's, the runtime (streams) knows no stage, and a stage reaches another stage only through its spec, client
facade or errors — never its handler. Packages under workers/ without a spec (common, inference) are libraries any
stage may use."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_OF_A_STAGE = {"spec", "client", "errors"}


def _imports() -> list[tuple[str, str]]:
    """(importing file relative to the root, imported kiln module) for every import of kiln code."""
    found = []
    for top in ("schemas", "streams", "workers", "ingest"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                found += [(str(path.relative_to(ROOT)), n) for n in names if n.startswith("kiln.")]
    return found


def test_schemas_is_a_leaf_and_the_runtime_knows_no_stage() -> None:
    imports = _imports()
    assert len(imports) > 200
    assert [(f, m) for f, m in imports if f.startswith("schemas/") and not m.startswith("kiln.schemas")] == []
    assert [(f, m) for f, m in imports
            if f.startswith("streams/") and not m.startswith(("kiln.streams", "kiln.schemas"))] == []


def _is_stage(package: str) -> bool:
    """A package under workers/ is a stage when it declares a spec; others (common, inference) are libraries."""
    return (ROOT / "workers" / package / "spec.py").exists()


def test_a_stage_uses_another_stage_only_through_its_spec_client_or_errors() -> None:
    assert _is_stage("exec") and _is_stage("rollout") and not _is_stage("common") and not _is_stage("inference")
    crossings = []
    for importer, module in _imports():
        parts = module.split(".")
        if parts[1] != "workers" or len(parts) < 3 or not _is_stage(parts[2]):
            continue
        own = importer.split("/")[1].removesuffix(".py") if importer.startswith("workers/") else None
        if parts[2] != own and (len(parts) < 4 or parts[3] not in PUBLIC_OF_A_STAGE):
            crossings.append((importer, module))
    assert crossings == []
