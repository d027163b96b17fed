"""The languages the SandboxFusion-compatible ``run_code`` serves: a source file name, a compile command (for the
compiled ones) and a run command, each run as one step of a ``run_once`` call in the run directory.

A compiled language has its own cap on ``compile_timeout`` (``KILN_GATEWAY_MAX_COMPILE_S`` overrides it), as its
compiler's time differs. Measured in a container of the toolchain image limited to one CPU (a runner's default) with
an empty build cache (what every ``run_code`` call gets), on this 2-core machine while other work loaded it (load
average 26-37), as CPU seconds and wall seconds:

- ``cpp``: ``g++ -O2`` of a hello 0.3 s CPU (0.9 s wall); of a ``<bits/stdc++.h>`` program with sort, map, set and a
  priority queue 1.4 s (3.3 s).
- ``rust``: ``rustc -O`` links the prebuilt std: a hello 0.14 s (0.3 s); a program using HashMap, BTreeMap, HashSet,
  BinaryHeap, VecDeque and iterator chains 0.8 s (4.2 s).
- ``go``: every call starts with an empty ``GOCACHE``, so ``go build`` first compiles the std packages the program
  imports: a ``fmt`` hello 11.6 s CPU (67 s wall under that load: a 60 s cap failed it), adding ``encoding/json``,
  ``sort``, ``strconv`` 12.7 s (70 s), ``net/http`` 27.8 s (79 s).

So 120 s for cpp and rust, the ``compile_timeout`` SandboxFusion's clients usually send: 35x the loaded wall time of
the larger programs, while a template or macro bomb is stopped at two minutes. 300 s for go: its floor is the std
build, already past a minute on a loaded node, and it grows with what the program imports (``net/http`` more than
doubles its CPU); 300 s leaves that build 4x its loaded wall time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    source: str
    run: str
    compile: str | None = None
    compile_cap_s: float | None = None  # the default cap on compile_timeout (compiled languages)


# Commands run in /work/run of a session on the toolchain image (infra/docker/toolchain.Dockerfile).
LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", "python3 main.py"),
    "bash": Language("main.sh", "bash main.sh"),
    "nodejs": Language("main.js", "node main.js"),
    "cpp": Language("main.cpp", "./main", "g++ -O2 -std=c++17 -o main main.cpp", 120.0),
    "go": Language("main.go", "./main", "GOCACHE=/tmp/go-build GOPATH=/tmp/go go build -o main main.go", 300.0),
    "rust": Language("main.rs", "./main", "rustc -O --edition 2021 -o main main.rs", 120.0),
}

COMPILE_CAPS: dict[str, float] = {name: lang.compile_cap_s for name, lang in LANGUAGES.items()
                                  if lang.compile_cap_s is not None}
