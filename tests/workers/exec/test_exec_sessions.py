"""The exec stage on the real broker and real Docker: pipelined sessions, tests with coverage, lint, forks,
isolation against adversarial commands, session proofs, and a worker killed mid-session."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.schemas.exec import ExecResult, SessionLimits
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.exec.auth import ClientKeyPair
from kiln.workers.exec.client import ExecClient, ExecSession, SpillOver
from tests.streams.harness import read_all
from tests.workers.exec.conftest import exec_worker, session_containers

pytestmark = pytest.mark.docker



async def test_pipelined_session_lint_tests_and_coverage(project_image: str, exec_settings: KilnSettings,
                                                         worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "agent") as kiln:
        client = ExecClient(kiln)
        session = await client.open_session(project_image, repository="demo/exec")
        extra = "import os\n\n\ndef neg(a):\n    return -a\n"
        # Pipelined: all three sent before the first result arrives; they must run in this order.
        futures = [await client.submit(session, "write_files", files=[{"path": "calc/extra.py", "text": extra}]),
                   await client.submit(session, "lint"),
                   await client.submit(session, "run_tests", timeout_s=300)]
        envelopes = [await f for f in futures]
        assert [e.finished_at for e in envelopes] == sorted(e.finished_at for e in envelopes)  # in order sent
        results: list[ExecResult] = [kiln.result_of(e) for e in envelopes]
        lint, tests = results[1], results[2]
        assert any(f.path == "calc/extra.py" and f.code == "F401" for f in lint.findings), lint.findings
        report = tests.tests
        assert report is not None and report.passed == 2 and report.failed == 0
        assert report.coverage is not None
        counts = {f.path: (len(f.executable_lines), len(f.covered_lines)) for f in report.coverage.files}
        # calc/__init__.py as built (8 statements, 6 run) + the written module: 3 statements (import, def,
        # return), none run since nothing imports it.
        assert counts["calc/__init__.py"] == (8, 6)
        assert counts["calc/extra.py"] == (3, 0)
        out = await client.run(session, "cat calc/extra.py && id -u && pwd")
        assert out.stdout == extra + "1000\n/work\n"
        files = await client.read_files(session, ["calc/extra.py"])
        assert files == {"calc/extra.py": extra.encode()}
        patch = ("--- a/calc/extra.py\n+++ b/calc/extra.py\n@@ -1,5 +1,5 @@\n-import os\n+import sys\n \n \n"
                 " def neg(a):\n     return -a\n")
        patched = kiln.result_of(await (await client.submit(session, "apply_patch", patch=patch)))
        assert patched.output is not None and patched.output.exit_code == 0, patched.output
        assert (await client.read_files(session, ["calc/extra.py"]))["calc/extra.py"].startswith(b"import sys\n")
        deleted = kiln.result_of(await (await client.submit(session, "delete_files", paths=["calc/extra.py"])))
        assert deleted.output is not None and deleted.output.exit_code == 0
        assert (await client.run(session, "ls calc")).stdout.split() == ["__init__.py"]
        await client.close_session(session)


async def test_sessions_run_concurrently_and_forks_carry_tmpfs_state(project_image: str,
                                                                    exec_settings: KilnSettings,
                                                                    worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "agent") as kiln:
        client = ExecClient(kiln)
        a, b = await asyncio.gather(client.open_session(project_image), client.open_session(project_image))
        # Each command notes when it started and ended (the containers share the host's clock): concurrent runs
        # overlap, one after the other would not.
        span = 'date +%s.%N; sleep 2; echo {}; date +%s.%N'
        outs = await asyncio.gather(client.run(a, span.format("a")), client.run(b, span.format("b")))
        (a_start, a_said, a_end), (b_start, b_said, b_end) = (o.stdout.split() for o in outs)
        assert (a_said, b_said) == ("a", "b")
        assert float(a_start) < float(b_end) and float(b_start) < float(a_end)  # not one after the other
        await client.run(a, "echo work > /work/state.txt; echo scratch > /tmp/scratch.txt")
        fork = await client.fork(a)
        seen = await client.run(fork, "cat /work/state.txt /tmp/scratch.txt")
        assert seen.stdout == "work\nscratch\n"
        await client.run(fork, "echo changed > /work/state.txt")
        assert (await client.run(a, "cat /work/state.txt")).stdout == "work\n"
        await asyncio.sleep(2)  # the warm pool refills after an open
        pair = ClientKeyPair()
        warm = kiln.result_of(await (await kiln.submit("exec", {"op": "open", "image": project_image,
                                                                "client_key": pair.public_b64}, key="w")))
        assert warm.warm and warm.sealed_key
        brief = await client.open_session(project_image, limits=SessionLimits(idle_timeout_s=1))
        await asyncio.sleep(3.5)  # the reaper runs every second here
        with pytest.raises(RequestFailed, match="SessionLost"):
            await client.run(brief, "true")
        for s in (a, b, fork, ExecSession(warm.session_id, pair.unseal(warm.sealed_key), warm.partition or 0,
                                          project_image)):
            await client.close_session(s)


@pytest.fixture
def secret_worker(exec_settings: KilnSettings, tmp_path: Path) -> Iterator[tuple[Path, str, int]]:
    """An exec worker holding a host secret twice: in its environment and in a file of its own state directory;
    yields the file, the secret and the worker's metrics port."""
    locks = tmp_path / "locks"
    locks.mkdir()
    secret = locks / "host-secret.txt"
    secret.write_text(f"do-not-read-{uuid.uuid4().hex}")
    port = free_port()
    with exec_worker(exec_settings, locks, KILN_TEST_HOST_SECRET=secret.read_text(),
                     KILN_METRICS_PORT=str(port)) as w:
        w.wait_assigned()
        yield secret, secret.read_text(), port


async def test_isolation_against_adversarial_commands(project_image: str, exec_settings: KilnSettings,
                                                      secret_worker: tuple[Path, str, int]) -> None:
    secret, secret_text, metrics_port = secret_worker
    limits = SessionLimits(memory_mb=256, pids=128, disk_mb=64, cpus=1)
    async with KilnClient(exec_settings, "agent") as kiln:
        client = ExecClient(kiln)
        s = await client.open_session(project_image, limits=limits)
        net = await client.run(s, "python3 -c \"import socket; socket.create_connection(('10.0.0.1', 80), 3)\"; "
                                  "getent hosts pypi.org || echo no-dns", timeout_s=20)
        assert net.exit_code == 0 and "no-dns" in net.stdout and "Network is unreachable" in net.stderr
        bomb = await client.run(s, "bomb() { bomb | bomb & }; bomb; sleep 5", timeout_s=8)
        assert "Resource temporarily unavailable" in bomb.stderr  # the pids limit held
        after = await client.run(s, "ps -eo args | grep -c '[b]omb' || true")
        assert after.stdout.strip() == "0"  # nothing of the bomb outlived its command
        memory = await client.run(s, "python3 -c \"x = bytearray(1 << 30); print(len(x))\"", timeout_s=30)
        assert memory.exit_code != 0 and "1073741824" not in memory.stdout
        disk = await client.run(s, "dd if=/dev/zero of=/work/fill bs=1M count=200 2>&1; rm -f /work/fill",
                                timeout_s=30)
        assert "No space left on device" in disk.stdout
        slow = await client.run(s, "sleep 30; echo finished", timeout_s=2)
        assert slow.timed_out and "finished" not in slow.stdout
        assert (await client.run(s, "ps -eo args | grep -c '[s]leep 30$' || true")).stdout.strip() == "0"
        stubborn = await client.run(s, "trap '' TERM; setsid bash -c \"trap '' TERM; sleep 300\" & sleep 300",
                                    timeout_s=2)
        assert stubborn.timed_out
        left = await client.run(s, "ps -eo args | grep -c '[s]leep 300' || true")
        assert left.stdout.strip() == "0"  # the escaped, SIGTERM-ignoring child was killed too
        async with httpx.AsyncClient() as http:  # ... by host pid, from outside, and counted
            metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        killed = next(line for line in metrics.splitlines() if line.startswith("kiln_exec_killed_processes_total "))
        assert float(killed.split()[-1]) >= 1
        privileged = await client.run(s, f"id -u; cat {secret} 2>&1; env; cat /proc/1/environ 2>&1; "
                                         "touch /usr/x 2>&1; ls /root 2>&1 | head -1; cat /proc/self/mountinfo")
        # The worker holds the secret (its environment, its state directory): nothing of it reaches the session.
        assert privileged.stdout.startswith("1000\n") and secret_text not in privileged.stdout
        assert str(secret.parent) not in privileged.stdout.replace(f"cat: {secret}", "")
        assert "Read-only file system" in privileged.stdout
        assert (await client.run(s, "echo still alive")).stdout == "still alive\n"
        forged = ExecSession(s.session_id, b"a guessed session key of 32 byte", s.partition, s.image)
        with pytest.raises(RequestFailed, match="SessionDenied"):
            await client.run(forged, "id")
        with pytest.raises(RequestFailed, match="SessionLost"):
            await client.run(ExecSession("0" * 32, s.key, s.partition, s.image), "id")
        with pytest.raises(RequestFailed, match="not allowed"):
            await client.open_session("kiln-evil/image:latest")
        await client.close_session(s)
    # Refused and lost sessions are answers, not poison: nothing of this went to the dead-letter topic.
    assert read_all(exec_settings, exec_settings.topic("exec.requests.dlq")) == []


async def test_worker_killed_mid_session_loses_it_cleanly(project_image: str, exec_settings: KilnSettings,
                                                          docker_engine: Any, tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    with exec_worker(exec_settings, locks) as doomed:
        doomed.wait_assigned()
        async with KilnClient(exec_settings, "agent") as kiln:
            client = ExecClient(kiln)
            session = await client.open_session(project_image)
            pending = await client.submit(session, "run", command="sleep 20; echo done", timeout_s=60)
            await asyncio.sleep(2)
            doomed.kill()
            owner = {c.labels["kiln.worker"] for c in session_containers(docker_engine)
                     if c.labels.get("kiln.lock", "").startswith(str(locks.resolve()))}
            assert owner
            with exec_worker(exec_settings, locks) as survivor:
                survivor.wait_assigned()
                with pytest.raises(RequestFailed, match="SessionLost"):
                    kiln.result_of(await asyncio.wait_for(pending, 120))
                deadline = time.monotonic() + 30
                while any(c.labels["kiln.worker"] in owner for c in session_containers(docker_engine)):
                    assert time.monotonic() < deadline, "the dead worker's containers were not reaped"
                    await asyncio.sleep(0.5)


def test_hot_repositories_spill_over_to_more_keys() -> None:
    spill = SpillOver(sessions_per_key=2)
    keys = []
    for _ in range(5):
        keys.append(spill.key_for("hot/repo"))
        spill.opened("hot/repo")
    assert keys == ["hot/repo#0", "hot/repo#0", "hot/repo#1", "hot/repo#1", "hot/repo#2"]
    spill.closed("hot/repo")
    assert spill.key_for("hot/repo") == "hot/repo#2" and spill.key_for("cold/repo") == "cold/repo#0"


async def test_sessions_survive_a_scale_out(project_image: str, stage_topics: Callable[..., KilnSettings],
                                            tmp_path: Path) -> None:
    settings = stage_topics(("exec.requests", 2))
    with exec_worker(settings, tmp_path / "locks-a") as first:
        first.wait_assigned()
        async with KilnClient(settings, "agent") as kiln:
            client = ExecClient(kiln, sessions_per_key=1)
            sessions: list[ExecSession] = []
            for i in range(12):  # until both partitions hold a session
                sessions.append(await client.open_session(project_image, repository=f"repo-{i}"))
                if {s.partition for s in sessions} == {0, 1}:
                    break
            assert {s.partition for s in sessions} == {0, 1}
            for s in sessions:
                await client.run(s, f"echo {s.session_id} > /work/state.txt; echo scratch > /tmp/t.txt")
            with exec_worker(settings, tmp_path / "locks-b") as second:
                second.wait_assigned()  # the group rebalanced: one partition moved, with its sessions
                workers = set()
                for s in sessions:
                    envelope = await (await client.submit(s, "run", command="cat /work/state.txt /tmp/t.txt"))
                    output = kiln.result_of(envelope).output
                    assert output is not None and output.stdout == f"{s.session_id}\nscratch\n", output
                    workers.add(envelope.worker)
                assert len(workers) == 2, "no session moved to the new worker"
                for s in sessions:
                    await client.close_session(s)
