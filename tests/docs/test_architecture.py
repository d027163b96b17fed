"""docs/architecture.md shows the toy stage's files as they are, and names only code that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
TOY = ROOT / "tests" / "fixtures" / "toy_stage"


def test_the_worked_example_is_the_tested_toy_stage_verbatim() -> None:
    for path in [TOY / "pyproject.toml", *(TOY / "kiln_wordcount" / f"{m}.py" for m in ("spec", "stage", "client"))]:
        assert f"```{'toml' if path.suffix == '.toml' else 'python'}\n{path.read_text()}```" in DOC, path
    files = [TOY / "pyproject.toml", *(TOY / "kiln_wordcount" / f"{m}.py" for m in ("spec", "stage", "client"))]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert f"`tests/fixtures/toy_stage/` ({lines} lines with its" in DOC


def test_every_code_path_the_document_names_exists() -> None:
    named = set(re.findall(r"`((?:streams|schemas|workers|ingest|rl|integrations|tests|infra)/[\w/.]+)`", DOC))
    assert len(named) > 15
    assert [p for p in sorted(named) if not (ROOT / p).exists()] == []


def test_the_verifier_example_is_the_tested_toy_verifier_verbatim() -> None:
    toy = ROOT / "tests" / "fixtures" / "toy_verifier"
    for path in (toy / "pyproject.toml", toy / "kiln_wordlen" / "verifier.py"):
        assert f"```{'toml' if path.suffix == '.toml' else 'python'}\n{path.read_text()}```" in DOC, path
    assert "`kiln.verifiers`" in DOC and "tests/workers/verify/test_verifier_plugins.py" in DOC


def test_the_package_table_is_the_tree() -> None:
    """One row per package: the top-level ones and every package one level below them (``kiln.workers`` has only
    its packages), and no row for a directory that is not one."""
    rows = set(re.findall(r"^\| `kiln\.[\w.]+` \| `([\w/]+)/` \|", DOC, flags=re.M))
    tops = ("schemas", "streams", "workers", "ingest", "rl", "integrations")
    tree = {"schemas", "streams", "ingest", "rl", "integrations"} | {
        f"{top}/{p.name}" for top in tops for p in (ROOT / top).iterdir() if (p / "__init__.py").is_file()}
    assert rows == tree


def test_blocking_work_follows_the_rule_the_runtime_enforces() -> None:
    """A thread the runtime cannot wait for would run beside the job's retry: the document says ctx.cancel.run."""
    assert "ctx.cancel.run" in DOC and "`asyncio.to_thread` or" not in DOC
    assert "ctx.cancel.run" in (ROOT / "streams" / "cancel.py").read_text()


def test_the_diagram_has_every_topic_kiln_creates() -> None:
    from kiln.streams.stage import topology

    diagram = DOC[DOC.index("```mermaid"):DOC.index("```", DOC.index("```mermaid") + 3)]
    topics = {t.name for t in topology() if not t.name.endswith(".dlq")} | {"policy.updates"}
    assert [t for t in sorted(topics) if t not in diagram] == []


def test_every_extension_point_and_published_design_is_named() -> None:
    points = DOC[DOC.index("## Extension points"):DOC.index("## Adding a stage")]
    for contract in ("`kiln.stages`", "`kiln.verifiers`", "a task source", "`InferenceEndpoint`", "`kiln.commands`"):
        assert contract in points, contract
    designs = DOC[DOC.index("## Published designs kiln follows"):]
    assert "Harmonic" in designs and "poolside" in designs and "PipelineRL" in designs


def test_no_page_cites_a_document_a_user_has_never_seen() -> None:
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "infra" / "k8s" / "README.md"]
    sources = [p for d in ("streams", "workers", "ingest", "schemas", "rl", "integrations", "bench")
               for p in (ROOT / d).rglob("*.py")]
    cited = [str(p.relative_to(ROOT)) for p in [*pages, *sources]
             if re.search(r"\b[Ss]eed 0\d\d\b|\bthe seed's\b|\bseed's rule\b|\(seed 0", p.read_text())]
    assert cited == []
