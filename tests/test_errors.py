"""Every error kiln raises on purpose derives from ``KilnError`` (streams/errors.py: the retry semantics live in the
classes) and is declared in its package's ``errors.py``, where a reader looks for what a package can raise."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("schemas", "streams", "workers", "ingest", "rl", "integrations")
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _classes() -> list[tuple[str, str, list[str]]]:
    """(file relative to the root, class, names of its bases) for every top-level class of kiln's code."""
    found = []
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                             for b in node.bases]
                    found.append((str(path.relative_to(ROOT)), node.name, bases))
    return found


def test_every_deliberate_error_is_a_kiln_error_declared_in_an_errors_module() -> None:
    classes = _classes()
    errors = {"KilnError"}
    grew = True
    while grew:  # the classes that derive, through kiln's own, from KilnError
        before = len(errors)
        errors |= {name for _, name, bases in classes if errors & set(bases)}
        grew = len(errors) > before
    assert {"SessionError", "VerifyError", "ReportError", "PeerError", "SaucerError"} <= errors
    exceptions = [(f, name) for f, name, bases in classes
                  if name in errors or BUILTIN_EXCEPTIONS & set(bases)]
    assert [(f, n) for f, n in exceptions if n not in errors] == []  # none outside the tree
    # Declared in the package's errors.py; a module's private helper exception (``_Name``) may stay beside its use.
    assert [(f, n) for f, n in exceptions if not f.endswith("/errors.py") and not n.startswith("_")] == []
