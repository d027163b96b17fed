"""How tests and benchmarks run the fake Lean REPL (tests/fakes/lean_repl.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

FAKE_REPL = Path(__file__).resolve().parents[2] / "fakes" / "lean_repl.py"
FAKE_COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_REPL))}"

THEOREMS = (  # p -> p and True;  q or r -> r or q;  a = a
    "theorem t1 : p \u2192 p \u2227 True := by sorry\n"
    "theorem t2 : q \u2228 r \u2192 r \u2228 q := sorry\n"
    "theorem t3 : a = a := by sorry"
)
