"""The languages the SandboxFusion-compatible ``run_code`` serves, and the driver that runs one request inside an
exec session: it writes the files, compiles with the compile timeout, runs with stdin and the run timeout, and
prints one JSON line with both results (one round trip per request instead of one per step)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    source: str
    run: str
    compile: str | None = None


# Commands run in /work/<request dir> of a session on the toolchain image (infra/docker/toolchain.Dockerfile).
LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", "python3 main.py"),
    "bash": Language("main.sh", "bash main.sh"),
    "nodejs": Language("main.js", "node main.js"),
    "cpp": Language("main.cpp", "./main", "g++ -O2 -std=c++17 -o main main.cpp"),
    "go": Language("main.go", "./main", "go build -o main main.go"),
    "rust": Language("main.rs", "./main", "rustc -O --edition 2021 -o main main.rs"),
}

DRIVER = r'''
import base64, json, os, signal, subprocess, sys, time
spec = json.loads(base64.b64decode(open(sys.argv[1]).read() if sys.argv[1].endswith(".json") else sys.argv[1]))
os.makedirs("run", exist_ok=True)
os.chdir("run")
for path, content in spec["files"].items():
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(content))
env = dict(os.environ, GOCACHE="/tmp/go-build", GOPATH="/tmp/go", GOFLAGS="-mod=mod")
def step(command, timeout, stdin):
    started = time.monotonic()
    process = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True, env=env)
    try:
        out, err = process.communicate(stdin.encode() if stdin is not None else None, timeout=timeout)
        status = "Finished"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        status = "TimeLimitExceeded"
    cap = spec["max_output"]
    return {"status": status, "execution_time": round(time.monotonic() - started, 4),
            "return_code": process.returncode if status == "Finished" else None,
            "stdout": out[:cap].decode(errors="replace"), "stderr": err[:cap].decode(errors="replace")}
result = {"compile_result": None, "run_result": None, "files": {}}
if spec["compile"]:
    result["compile_result"] = step(spec["compile"], spec["compile_timeout"], None)
if result["compile_result"] is None or result["compile_result"]["return_code"] == 0:
    result["run_result"] = step(spec["run"], spec["run_timeout"], spec["stdin"])
for path in spec["fetch_files"]:
    try:
        with open(path, "rb") as f:
            result["files"][path] = base64.b64encode(f.read()).decode()
    except OSError:
        pass
print(json.dumps(result, ensure_ascii=False))
'''
