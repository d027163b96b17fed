"""The languages the SandboxFusion-compatible ``run_code`` serves, and the driver that runs one request inside an
exec session as ONE bash command (no interpreter of its own to start): it writes the files, compiles with the
compile timeout, runs with stdin and the run timeout, and prints a line per step and per fetched file."""

from __future__ import annotations

import base64
import shlex
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

# ``timeout`` signals its whole process group, so a step's children die with it. Output: ``STEP <name> <exit code>
# <microseconds> <stdout b64> <stderr b64>``, each stream cut at the cap first.
_STEP = """step() {
  local t0 t1 rc
  t0=$(date +%s%N)
  timeout -s KILL "$2" bash -c "$3" < "$4" > ".kiln-$1.out" 2> ".kiln-$1.err"; rc=$?
  t1=$(date +%s%N)
  echo "STEP $1 $rc $(( (t1 - t0) / 1000 )) $(head -c $CAP ".kiln-$1.out" | base64 -w0) \
$(head -c $CAP ".kiln-$1.err" | base64 -w0)"
  return $rc
}
"""


def write_file(path: str, content_b64: str) -> str:
    """The shell line that writes one file of the run directory."""
    target = shlex.quote(path)
    return f"mkdir -p \"$(dirname {target})\" && printf %s {shlex.quote(content_b64)} | base64 -d > {target}\n"


def driver(language: Language, *, writes: str, stdin: str | None, compile_timeout: float, run_timeout: float,
           fetch_files: list[str], cap: int) -> str:
    """The bash script for one request; ``writes`` are ``write_file`` lines (empty when the files were written
    beforehand with the exec stage's write_files)."""
    script = f"CAP={cap}\nmkdir -p run && cd run || exit 90\n{_STEP}{writes}"
    stdin_file = "/dev/null"
    if stdin is not None:
        script += write_file(".kiln-stdin", base64.b64encode(stdin.encode()).decode())
        stdin_file = ".kiln-stdin"
    run = f"step run {run_timeout:g} {shlex.quote(language.run)} {stdin_file}"
    if language.compile is not None:
        run = f"step compile {compile_timeout:g} {shlex.quote(language.compile)} /dev/null && {run}"
    script += run + "\n"
    for path in fetch_files:
        quoted = shlex.quote(path)
        script += (f"[ -f {quoted} ] && echo \"FILE $(printf %s {quoted} | base64 -w0) $(base64 -w0 < {quoted})\"\n")
    return script + "exit 0\n"
