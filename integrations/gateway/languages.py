"""The languages the SandboxFusion-compatible ``run_code`` serves: a source file name, a compile command (for the
compiled ones) and a run command, each run as one step of a ``run_once`` call in the run directory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    source: str
    run: str
    compile: str | None = None


# Commands run in /work/run of a session on the toolchain image (infra/docker/toolchain.Dockerfile).
LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", "python3 main.py"),
    "bash": Language("main.sh", "bash main.sh"),
    "nodejs": Language("main.js", "node main.js"),
    "cpp": Language("main.cpp", "./main", "g++ -O2 -std=c++17 -o main main.cpp"),
    "go": Language("main.go", "./main", "GOCACHE=/tmp/go-build GOPATH=/tmp/go go build -o main main.go"),
    "rust": Language("main.rs", "./main", "rustc -O --edition 2021 -o main main.rs"),
}
