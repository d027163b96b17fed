"""The dependency direction of docs/architecture.md, checked on every import in the package: schemas imports nothing
of kiln's, the runtime (streams) knows no stage, a stage reaches another stage only through its spec, client facade
or errors — never its handler — and the RL loop (rl/) and the integrations (integrations/) build on the stages, never
the other way round. Packages under workers/ without a spec (common, inference) are libraries any stage may use."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_OF_A_STAGE = {"spec", "client", "errors"}
TOPS = ("schemas", "streams", "workers", "ingest", "rl", "integrations")
BELOW_THE_LOOP = ("schemas/", "streams/", "workers/", "ingest/")
# The old import paths trainer configs name, kept for one release (each warns): the only modules below the loop that
# import an integration, and only the one they stand for.
DEPRECATED_PATHS = {
    "workers/rewards/__init__.py": "kiln.integrations.trainers.trl",
    "workers/trainers/__init__.py": "kiln.integrations.trainers",
    **{f"workers/trainers/{name}.py": f"kiln.integrations.trainers.{name}"
       for name in ("verl", "areal", "openrlhf", "prime")},
}


def _imports() -> list[tuple[str, str]]:
    """(importing file relative to the root, imported kiln module) for every import of kiln code."""
    found = []
    for top in TOPS:
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


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_nothing_below_the_rl_loop_imports_it_or_the_integrations() -> None:
    imports = _imports()
    assert any(f.startswith("rl/") for f, _ in imports) and any(f.startswith("integrations/") for f, _ in imports)
    upward = [(f, m) for f, m in imports if f.startswith(BELOW_THE_LOOP)
              and (_within(m, "kiln.rl") or _within(m, "kiln.integrations")) and DEPRECATED_PATHS.get(f) != m]
    assert upward == []
    assert [(f, m) for f, m in imports if f.startswith("rl/") and _within(m, "kiln.integrations")] == []


def test_the_deprecated_paths_are_shims_only() -> None:
    """Each old path holds nothing but its warning and the re-export of the module it stands for."""
    for path, module in DEPRECATED_PATHS.items():
        tree = ast.parse((ROOT / path).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert imported == {"__future__", module}, path
        assert not [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)], path
    left = {str(p.relative_to(ROOT)) for d in ("gateway", "trainers", "rewards", "demo")
            for p in (ROOT / "workers" / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert left == set(DEPRECATED_PATHS)


def test_the_rollout_package_holds_the_stage_only() -> None:
    """The RL loop around the stage (actor, trainer, loss, learning runs, ``kiln rl``) lives in rl/."""
    assert {p.stem for p in (ROOT / "workers" / "rollout").glob("*.py")} == {"__init__", "spec", "stage", "episodes"}


def test_saucer_reaches_a_stage_only_through_the_ingest_facade_in_its_command() -> None:
    """Saucer's library (``ingest/``) builds on schemas and streams; its command ``kiln saucer ingest`` submits
    through the ingest stage's facade, like any client (docs/architecture.md)."""
    reached = {(f, m) for f, m in _imports() if f.startswith("ingest/") and _within(m, "kiln.workers")}
    assert reached == {("ingest/cli.py", "kiln.workers.ingest.client")}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


SETUP_COMPONENTS = {("streams/cli.py", "lean"), ("streams/infra.py", "lean")}
"""``kiln setup lean``: the local install of the Lean REPL's sandbox (bubblewrap), a machine's component, not the
stage."""

KUBERNETES_FIELDS = {("streams/k8s/render.py", "exec")}
"""A probe's ``exec`` handler (the engine sidecar's startup probe runs ``docker version``): Kubernetes' field name,
not the stage."""


def test_the_runtime_names_no_stage() -> None:
    """Beyond its imports, no code under streams/ names a registered stage or its request topic: what a stage needs
    of a deployment (slots, memory, a container engine, spare CPUs) comes from its spec (``StageSpec.deployment``)."""
    from kiln.streams.stage import stage_specs

    names = {k for k in stage_specs()} | {s.request_topic for s in stage_specs().values()}
    named = []
    for path in (ROOT / "streams").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        named += [(str(path.relative_to(ROOT)), n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs]
    assert len(names) >= 16
    assert set(named) == SETUP_COMPONENTS | KUBERNETES_FIELDS
