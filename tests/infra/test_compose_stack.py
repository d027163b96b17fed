"""`docker compose up`, for real: the README's compose commands bring the whole stack up from the images this machine
builds (infra/compose/no-hub.yml), and a user on the host uses it — the README's trainer snippet, a repository
ingested, built and tested through the stack's workers, patches scored on it by the verify worker, a batch through
the gateway with SandboxFusion's own client, the status page, a worker container killed mid-job whose job its
replacement replays — then `docker compose down -v` leaves no container, volume, network, sandbox or firewall rule
of the project behind.

The stack publishes its ports on loopback at free ports (KILN_STACK_*_PORT), beside the suite's own broker, S3 and
registry."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from sandbox_fusion import RunCodeRequest, RunStatus, run_code
from testcontainers.core.container import DockerContainer

from kiln.schemas.builder import BuildRequest
from kiln.schemas.builtin import SleepRequest, SleepResult
from kiln.schemas.ingest import IngestRequest
from kiln.schemas.rl import RolloutTask
from kiln.streams.client import KilnClient
from kiln.streams.infra import COMPONENT_STEPS, run_steps
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.builder.client import BuilderClient
from kiln.workers.exec.client import ExecClient
from kiln.workers.ingest.client import SaucerClient
from kiln.workers.verify.client import VerifyClient

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kiln"
CALC = ROOT / "integrations" / "demo" / "calc-repo"


def readme_commands() -> tuple[list[str], list[str]]:
    """The README's compose section: the no-hub `up` command and the `down` command, as the test runs them."""
    section = (ROOT / "README.md").read_text().split("## docker compose", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines()]
    up = next(line for line in lines if line.startswith("docker compose -f") and " up " in f"{line} ")
    down = next(line for line in lines if line.startswith("docker compose -f") and " down" in line)
    return up.split(), down.split()


def readme_snippet() -> str:
    """The README's trainer snippet (Install), as a coroutine function ``main``."""
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text().split("## Install", 1)[1], re.S)[0]
    imports = [line for line in code.splitlines() if line.startswith(("from ", "import "))]
    body = [line for line in code.splitlines() if line and not line.startswith(("from ", "import "))]
    return "\n".join([*imports, "async def main() -> None:", textwrap.indent("\n".join(body), "    ")])


@dataclass
class Stack:
    env: dict[str, str]
    ports: dict[str, int]
    repos: Path

    @property
    def settings(self) -> KilnSettings:
        return KilnSettings(bootstrap_servers=f"127.0.0.1:{self.ports['KAFKA']}")

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", "compose", "-f", "docker-compose.yml", "-f", "infra/compose/no-hub.yml",
                               *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def services(self) -> list[dict[str, Any]]:
        out = self.compose("ps", "-a", "--format", "json").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]


def stack_sandboxes() -> str:
    """Sandboxes (sessions, runners) of the stack's exec worker: its liveness locks live under /run/kiln/exec (the
    suite's own exec workers lock under their temp dirs)."""
    listed = subprocess.run(["docker", "ps", "-a", "--filter", "label=kiln.lock", "--format",
                             '{{.ID}} {{.Label "kiln.lock"}}'], capture_output=True, text=True, check=True).stdout
    return " ".join(line.split()[0] for line in listed.splitlines() if line.split()[1].startswith("/run/kiln/exec/"))


def leftovers() -> dict[str, str]:
    """Whatever of the project the engine (and the host's firewall) still has."""
    label = f"label=com.docker.compose.project={PROJECT}"
    found = {"sandbox": stack_sandboxes()}
    for kind in ("container", "volume", "network"):
        listing = ["docker", kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", label]
        found[kind] = subprocess.run(listing, capture_output=True, text=True, check=True).stdout.strip()
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=False).stdout
    found["iptables"] = "\n".join(line for line in rules.splitlines() if "KILN-STACK-EGRESS" in line)
    return {kind: ids for kind, ids in found.items() if ids}


# The stack's first start builds the worker image (its dependency layer when pyproject.toml changed: minutes on a
# loaded 2-core machine); the `up` itself is bounded at 900 s below.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def stack(docker_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_steps(COMPONENT_STEPS["compose"])
    repos = tmp_path_factory.mktemp("stack-repos")
    ports = {name: free_port() for name in ("KAFKA", "S3", "REGISTRY", "SAUCER", "GATEWAY", "STATUS", "PROMETHEUS",
                                            "BUILD_METRICS", "EXEC_METRICS")}
    env = {**os.environ, **{f"KILN_STACK_{name}_PORT": str(port) for name, port in ports.items()},
           "KILN_S3_ACCESS_KEY": secrets.token_hex(8), "KILN_S3_SECRET_KEY": secrets.token_hex(24),
           "KILN_SAUCER_TOKEN": secrets.token_hex(24), "KILN_GATEWAY_API_KEY": secrets.token_hex(24),
           "KILN_STACK_REPOS": str(repos)}
    for inherited in ("COMPOSE_FILE", "COMPOSE_PROJECT_NAME", "KILN_BOOTSTRAP_SERVERS"):
        env.pop(inherited, None)
    stack = Stack(env, ports, repos)
    up, _ = readme_commands()
    stack.compose("down", "-v", "--remove-orphans", check=False)  # an earlier run's, killed before its teardown
    try:
        started = subprocess.run(up, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert started.returncode == 0, (started.stdout[-3000:], started.stderr[-6000:],
                                         stack.compose("logs", "--tail", "30", check=False).stdout[-8000:])
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", check=False)


def test_every_service_is_up_and_healthy(stack: Stack) -> None:
    services = {s["Service"]: s for s in stack.services()}
    assert {"broker", "s3", "registry", "topics", "egress", "egress-check", "worker-echo", "worker-sleep",
            "worker-ingest", "worker-verify", "worker-build", "worker-exec", "saucer", "gateway", "stats", "status",
            "prometheus"} <= set(services)
    one_shots = {"topics", "egress-check"}
    for name, service in services.items():
        if name in one_shots:
            assert service["State"] == "exited" and service["ExitCode"] == 0, service
        else:
            assert service["State"] == "running", service
            assert service["Health"] in ("healthy", ""), service
    # Every kiln service's image carries what it imports: each of these is a command of an extra.
    with_health = {n for n, s in services.items() if s["Health"] == "healthy"}
    assert {"worker-build", "worker-exec", "saucer", "gateway", "stats", "status", "broker", "egress"} <= with_health


def test_the_readme_trainer_snippet_runs_against_the_stack(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(readme_snippet(), "README.md", "exec"), namespace)  # the README's own code
    os.environ["KILN_BOOTSTRAP_SERVERS"] = stack.settings.bootstrap_servers
    try:
        asyncio.run(asyncio.wait_for(namespace["main"](), 120))
    finally:
        del os.environ["KILN_BOOTSTRAP_SERVERS"]
    assert capsys.readouterr().out.strip() == "2"


def test_build_steps_reach_package_registries_through_the_stack_proxy_only(stack: Stack) -> None:
    def on_egress(*command: str) -> tuple[int, str, str]:
        """A throwaway container where build steps run: the stack's egress network, nothing else."""
        with DockerContainer("kiln/base:latest").with_kwargs(network="kiln-stack-egress") \
                .with_command(["sleep", "300"]) as probe:
            code, (out, err) = probe.get_wrapped_container().exec_run(list(command), demux=True)
        return code, (out or b"").decode(), (err or b"").decode()

    proxy = "http://172.31.251.1:3128"
    fetched = on_egress("python3", "-c", "import urllib.request as u; print(u.build_opener(u.ProxyHandler("
                        f"{{'https': '{proxy}'}})).open('https://pypi.org/simple/pip/', timeout=30).status)")
    assert fetched[1].strip() == "200", fetched
    for target in (f"http://127.0.0.1:{stack.ports['KAFKA']}/", "http://example.com/"):
        refused = on_egress("python3", "-c", "import urllib.request as u; u.build_opener(u.ProxyHandler("
                            f"{{'http': '{proxy}'}})).open('{target}', timeout=30)")
        assert "403" in refused[2], (target, refused)
    direct = on_egress("bash", "-c", f"exec 3<>/dev/tcp/172.31.251.1/{stack.ports['KAFKA']}")
    assert direct[0] != 0


def test_a_repository_is_ingested_built_and_tested_in_a_session(stack: Stack) -> None:
    checkout = stack.repos / "calc"
    shutil.copytree(CALC, checkout)
    # One commit id every run: the built image's tag is the same, so runs leave no new image on the engine (the
    # build itself is not cached: its record lived in the stack's S3, gone with `down -v`).
    fixed = {"GIT_AUTHOR_NAME": "kiln", "GIT_AUTHOR_EMAIL": "kiln@kiln.invalid", "GIT_COMMITTER_NAME": "kiln",
             "GIT_COMMITTER_EMAIL": "kiln@kiln.invalid", "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
             "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z", "PATH": "/usr/bin:/bin"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "calc"]):
        subprocess.run(["git", *args], cwd=checkout, env=fixed, check=True, capture_output=True)

    async def scenario() -> tuple[Any, Any, Any]:
        async with KilnClient(stack.settings, client_id="compose-test") as kiln:
            ingested = await SaucerClient(kiln).ingest_repository(
                IngestRequest(name="stack/calc", location="/repos/calc"))
            built = await BuilderClient(kiln).build(BuildRequest(repository="stack/calc"))
            assert built.usable and built.image is not None, (built.failure, built.detail)
            execs = ExecClient(kiln)
            session = await execs.open_session(built.image, repository="stack/calc")
            try:
                ran = await execs.run_tests(session)
            finally:
                await execs.close_session(session)
            # Rewards for two patches through the stack's verify worker (which runs them on its exec worker).
            task = RolloutTask(task_id="calc-mul", prompt="Fix calc.mul.", verifier="tests",
                               check={"image": built.image})
            verdicts = await VerifyClient(kiln).verify(task, [fix, fix.replace("a * b", "a - b")])
            return ingested, built, ran, verdicts

    source = (checkout / "calc" / "__init__.py").read_text()
    target = checkout / "calc" / "__init__.py"
    target.write_text(source.replace("def mul(a: int, b: int) -> int:\n    return a + b",
                                     "def mul(a: int, b: int) -> int:\n    return a * b"))
    fix = subprocess.run(["git", "diff"], cwd=checkout, capture_output=True, text=True, check=True).stdout
    target.write_text(source)
    assert "a * b" in fix
    # The ingest worker runs as uid 1000 (a laptop user's own repositories are theirs too).
    subprocess.run(["chown", "-R", "1000:1000", str(stack.repos)], check=True)
    ingested, built, ran, verdicts = asyncio.run(asyncio.wait_for(scenario(), 600))
    assert [(v.passed, v.failed) for v in verdicts] == [(3, 0), (1, 2)], verdicts  # a - b breaks two of calc's 3
    assert ingested.status == "ingested" and ingested.commits == 1
    assert built.system == "python" and not built.cached and built.tests is not None and built.tests.failed >= 1
    assert ran.tests is not None and ran.tests.passed >= 1 and ran.tests.failed >= 1  # calc's mul adds: one fails
    # Saucer serves the ingested repository from the stack's store.
    branches = httpx.get(f"http://127.0.0.1:{stack.ports['SAUCER']}/repos/stack/calc/-/revisions",
                         headers={"Authorization": f"Bearer {stack.env['KILN_SAUCER_TOKEN']}"}, timeout=30)
    assert branches.status_code == 200, branches.text
    assert [b["name"] for b in branches.json()["items"]] == ["main"]


def test_a_batch_through_the_gateway_with_sandbox_fusions_client(stack: Stack) -> None:
    key = quote(stack.env["KILN_GATEWAY_API_KEY"], safe="")
    endpoint = f"http://kiln:{key}@127.0.0.1:{stack.ports['GATEWAY']}"
    with pytest.raises(Exception, match="401"):
        run_code(RunCodeRequest(code="print(1)", language="python"),
                 endpoint=f"http://127.0.0.1:{stack.ports['GATEWAY']}", max_attempts=1)
    programs = [f"print({i} * {i})" for i in range(16)]
    with ThreadPoolExecutor(8) as pool:  # verl's pattern: the sync client in a thread pool
        answers = list(pool.map(lambda code: run_code(RunCodeRequest(code=code, language="python"),
                                                      endpoint=endpoint, max_attempts=1), programs))
    for i, answer in enumerate(answers):
        assert answer.status == RunStatus.Success, answer
        assert answer.run_result is not None and answer.run_result.stdout == f"{i * i}\n"


def test_the_status_page_shows_the_stacks_workers(stack: Stack) -> None:
    url = f"http://127.0.0.1:{stack.ports['STATUS']}"
    assert httpx.get(url, timeout=10).status_code == 200
    deadline = time.monotonic() + 90
    while True:
        status = httpx.get(f"{url}/api/status", timeout=10).json()
        seen = json.dumps(status)
        if all(stage in seen for stage in ("exec", "build", "ingest", "sleep")):
            break
        assert time.monotonic() < deadline, status
        time.sleep(2)


def test_a_worker_container_killed_mid_job_is_replaced_and_the_job_replayed(stack: Stack) -> None:
    sleepers = [s["ID"] for s in stack.services() if s["Service"] == "worker-sleep"]
    assert len(sleepers) == 2

    def restarts() -> list[int]:
        return [int(subprocess.run(["docker", "inspect", "--format", "{{.RestartCount}}", c], capture_output=True,
                                   text=True, check=True).stdout) for c in sleepers]

    before = restarts()
    pids = [int(subprocess.run(["docker", "inspect", "--format", "{{.State.Pid}}", c], capture_output=True, text=True,
                               check=True).stdout) for c in sleepers]

    async def scenario() -> tuple[SleepResult, float]:
        async with KilnClient(stack.settings, client_id="compose-kill") as kiln:
            pending = await kiln.submit("sleep", SleepRequest(seconds=8, tag="killed"))
            await asyncio.sleep(4)  # taken by a worker, mid-sleep
            killed = time.monotonic()
            for pid in pids:  # the whole process tree dies at once, as a preempted node's would
                os.kill(pid, 9)
            envelope = await asyncio.wait_for(pending, 180)
            return kiln.result_of(envelope), time.monotonic() - killed

    result, after_kill_s = asyncio.run(scenario())
    assert result.tag == "killed" and result.slept >= 8
    # Every worker that could have started it died 4 s into its 8 s: the answer is a replacement's whole run.
    assert after_kill_s >= 8, after_kill_s
    assert [a > b for a, b in zip(restarts(), before, strict=True)] == [True, True]


def test_down_leaves_nothing_of_the_project(stack: Stack) -> None:
    assert stack_sandboxes(), "the exec worker keeps warm runners while it runs"
    _, down = readme_commands()
    done = subprocess.run(down, cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert leftovers() == {}
