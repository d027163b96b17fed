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


def test_every_code_path_the_document_names_exists() -> None:
    named = set(re.findall(r"`((?:streams|schemas|workers|ingest|tests|infra)/[\w/.]+)`", DOC))
    assert len(named) > 15
    assert [p for p in sorted(named) if not (ROOT / p).exists()] == []


def test_the_verifier_example_is_the_tested_toy_verifier_verbatim() -> None:
    toy = ROOT / "tests" / "fixtures" / "toy_verifier"
    for path in (toy / "pyproject.toml", toy / "kiln_wordlen" / "verifier.py"):
        assert f"```{'toml' if path.suffix == '.toml' else 'python'}\n{path.read_text()}```" in DOC, path
    assert "`kiln.verifiers`" in DOC and "tests/workers/verify/test_verifier_plugins.py" in DOC
