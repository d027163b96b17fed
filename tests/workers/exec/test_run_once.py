"""``run_once``: a call costs a process in a warm runner, and is still a sandbox of its own. Each test tries to break
one promise as the judged code would: leave something for the next call, reach a concurrent one, forge or kill
the supervisor that measures it, cross a boundary of the threat model, or get lost with its worker."""

from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.schemas.exec import RunStep, SessionLimits
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.exec.client import ExecClient
from tests.stages import worker_env
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker
IMAGE = "kiln/toolchain:latest"

# Leaves something in every writable place and in every shared kernel object a container has, then a process.
LEAVE = r"""
echo secret > /work/left; echo secret > /tmp/left; echo secret > /dev/shm/left
python3 - <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0x4b494c4e, 4096, 0o1666) >= 0, "shmget"
assert libc.msgget(0x4b494c4e, 0o1666) >= 0, "msgget"
assert libc.semget(0x4b494c4e, 1, 0o1666) >= 0, "semget"
libc.mq_open.restype = ctypes.c_int
assert libc.mq_open(b"/left", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0, "mq_open"
EOF
setsid nohup bash -c 'while true; do echo again > /tmp/again; sleep 0.05; done' >/dev/null 2>&1 &
hostname
"""
# What the next call looks for.
LOOK = r"""
hostname
find /work /tmp /dev/shm /dev/mqueue -mindepth 1 -not -name look.sh | head
tail -n +2 /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem | grep -v '^==>' | grep -v '^$' | head
for p in /proc/[0-9]*; do [ "$(stat -c %u "$p")" = 1000 ] && tr '\0' ' ' < "$p/cmdline" && echo; done \
  | grep -v -e '^$' -e 'look.sh' -e 'stat -c' -e 'tr ' -e grep -e head
echo "SECRET=${SECRET:-unset}"
"""


@pytest.fixture
def one_slot_worker(exec_settings: KilnSettings, tmp_path: Path) -> Iterator[WorkerProcess]:
    """One slot, so one runner: consecutive calls run in the same container."""
    with WorkerProcess("exec", exec_settings, "exec.requests", slots=1, env=worker_env(
            exec_settings, KILN_EXEC_LOCK_DIR=str(tmp_path / "locks"), KILN_EXEC_REAP_INTERVAL_S="1",
            KILN_METRICS_PORT=str(free_port()))) as w:
        w.wait_assigned()
        yield w


async def test_nothing_of_a_call_reaches_the_next(exec_settings: KilnSettings, one_slot_worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "trainer") as kiln:
        client = ExecClient(kiln)
        left = await client.run_once(IMAGE, LEAVE, env={"SECRET": "s3cret"})
        assert left.output is not None and left.output.exit_code == 0, left.output
        looked = await client.run_once(IMAGE, "bash look.sh", files={"look.sh": LOOK})
    assert looked.output is not None and looked.output.exit_code == 0, looked.output
    lines = looked.output.stdout.splitlines()
    # The same container served both calls (a process per call, not a container)...
    assert lines[0] == left.output.stdout.strip()
    # ... and nothing of the first is there: files, shared memory, message queues, semaphores, processes, env.
    assert lines[1:] == ["SECRET=unset"], looked.output.stdout


async def test_the_judged_code_cannot_forge_read_or_kill_its_supervisor(
        exec_settings: KilnSettings, one_slot_worker: WorkerProcess) -> None:
    attack = r"""
sup=$(for p in /proc/[0-9]*; do grep -qa 'sup.serve' "$p/cmdline" 2>/dev/null && basename "$p"; done | head -1)
[ -n "$sup" ] || { echo "no supervisor seen"; exit 9; }
{ echo '{"steps":[{"name":"run","exit_code":0,"stdout":"Zm9yZ2Vk"}],"clean":true}' > /proc/$sup/fd/1; } 2>/dev/null \
  && echo WROTE || echo write-denied
cat /proc/$sup/environ >/dev/null 2>&1 && echo READ || echo read-denied
kill -9 "$sup" 2>/dev/null && echo KILLED || echo kill-denied
kill -STOP 1 2>/dev/null && echo STOPPED || echo init-denied
exit 3
"""
    async with KilnClient(exec_settings, "trainer") as kiln:
        client = ExecClient(kiln)
        result = await client.run_once(IMAGE, attack)
        after = await client.run_once(IMAGE, "echo still-here")
    assert result.output is not None
    assert result.output.exit_code == 3, result.output
    assert result.output.stdout.split() == ["write-denied", "read-denied", "kill-denied", "init-denied"]
    assert after.output is not None and after.output.stdout == "still-here\n"


async def test_concurrent_calls_cannot_reach_or_starve_each_other(exec_settings: KilnSettings,
                                                                  worker: WorkerProcess) -> None:
    hostile = ("kill -9 -1; pkill -9 -f sleep; ls /proc | grep -c '^[0-9]' > /work/pids; "
               "python3 -c 'x = bytearray(1 << 30)'; :(){ :|:& };: ; sleep 1")
    async with KilnClient(exec_settings, "trainer") as kiln:
        client = ExecClient(kiln)
        victims = [client.run_once(IMAGE, f"sleep 1.5; echo victim-{i}") for i in range(3)]
        attacker = client.run_once(IMAGE, hostile, limits=SessionLimits(memory_mb=128, pids=64), timeout_s=10)
        *done, attacked = await asyncio.gather(*victims, attacker)
    for i, result in enumerate(done):
        assert result.output is not None and result.output.exit_code == 0, result.output
        assert result.output.stdout == f"victim-{i}\n"
    assert attacked.output is not None and attacked.output.exit_code != 0


FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


async def test_a_fork_bomb_at_the_pids_limit_is_measured_never_a_lost_runner(exec_settings: KilnSettings,
                                                                           worker: WorkerProcess) -> None:
    """A fork bomb takes every pid its limit allows, and the supervisor shares that limit: before it kept threads in
    reserve, the Go runtime sometimes needed a new one mid-call (the timeout's /proc scan), could not start it, and
    aborted ("newosproc"), so about one bomb in twenty came back as a lost runner — kiln's failure, no reward —
    instead of its own timeout. Every bomb, at the smallest pids limit and a larger one, is a measured timeout."""
    async with KilnClient(exec_settings, "trainer") as kiln:
        client = ExecClient(kiln)
        bombs = [client.run_once(IMAGE, "python3 main.py", files={"main.py": FORK_BOMB}, timeout_s=1,
                                 limits=SessionLimits(pids=pids, cpus=0.25)) for pids in (16, 64) for _ in range(16)]
        results = await asyncio.gather(*bombs, return_exceptions=True)
        after = await client.run_once(IMAGE, "echo still-here", limits=SessionLimits(pids=16))
    lost = [r for r in results if isinstance(r, BaseException)]
    assert lost == [], lost[:3]
    assert all(r.output is not None and r.output.timed_out for r in results if not isinstance(r, BaseException))
    assert after.output is not None and after.output.stdout == "still-here\n"  # a helper still starts at 16 pids


async def test_the_threat_models_boundaries_hold_in_a_runner(exec_settings: KilnSettings,
                                                             worker: WorkerProcess) -> None:
    probe = r"""
id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status | tr -s '\t ' ' '; cat /proc/self/oom_score_adj
touch /usr/bin/kiln-wrote 2>/dev/null && echo image-written || echo image-read-only
python3 -c "import socket; socket.create_connection(('192.0.2.1', 80), 1)" 2>/dev/null && echo net || echo no-net
grep -v ' lo:' /proc/net/dev | tail -n +3 | wc -l
ours="^/(work|tmp|kiln|dev|proc|sys|etc/(hosts|hostname|resolv.conf)|usr/sbin/docker-init)"
awk -v ours="$ours" '$4 != "/" && $5 !~ ours' /proc/self/mountinfo
"""
    async with KilnClient(exec_settings, "trainer") as kiln:
        client = ExecClient(kiln)
        result = await client.run_once(IMAGE, probe)
        flood = await client.run_once(IMAGE, "yes kiln", max_output_bytes=1000, timeout_s=2)
        slow = await client.run_once(IMAGE, steps=[RunStep(name="build", command="sleep 30", timeout_s=1),
                                                   RunStep(name="test", command="echo never", timeout_s=5)])
        for limits in (SessionLimits(memory_mb=65536), SessionLimits(cpus=64), SessionLimits(pids=32768),
                       SessionLimits(disk_mb=65536)):
            with pytest.raises(RequestFailed, match="LimitExceeded"):
                await client.run_once(IMAGE, "true", limits=limits)
        with pytest.raises(RequestFailed, match=r"LimitExceeded.*steps\[run\]"):
            await client.run_once(IMAGE, "true", timeout_s=24 * 3600)
        with pytest.raises(RequestFailed, match="not allowed"):
            await client.run_once("debian:stable", "true")
    assert result.output is not None
    assert result.output.stdout.splitlines() == ["1000", "CapEff: 0000000000000000", "NoNewPrivs: 1", "1000",
                                                 "image-read-only", "no-net", "0"], result.output.stdout
    assert flood.output is not None and flood.output.stdout_truncated and len(flood.output.stdout) == 1000
    assert [(s.name, s.timed_out) for s in slow.steps] == [("build", True)]


async def test_a_step_past_its_time_is_killed_alone(exec_settings: KilnSettings, worker: WorkerProcess) -> None:
    """The kill of a step that ran past its time is over before the next step starts: an ``always`` step after it
    (the next test case of a SandboxFusion /submit) runs whole, each of three times in one call."""
    steps = [RunStep(name=f"{kind}{i}", command="sleep 30" if kind == "slow" else f"sleep 0.2; echo next{i}",
                     timeout_s=1 if kind == "slow" else 30, always=True) for i in range(3) for kind in ("slow", "next")]
    async with KilnClient(exec_settings, "trainer") as kiln:
        result = await ExecClient(kiln).run_once(IMAGE, steps=steps)
    assert [(s.name, s.timed_out) for s in result.steps] == [(s.name, s.name.startswith("slow")) for s in steps]
    assert [(s.exit_code, s.stdout) for s in result.steps if s.name.startswith("next")] == \
        [(0, f"next{i}\n") for i in range(3)], result.steps


async def test_files_in_and_out_and_the_images_work_restored(project_image: str, exec_settings: KilnSettings,
                                                              one_slot_worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "trainer") as kiln:
        client = ExecClient(kiln)
        first = await client.run_once(project_image, "ls > /tmp/listing; cat in/x > /tmp/b; rm -rf ./*; mkdir out; "
                                      "mv /tmp/listing /tmp/b out/; echo 42 > out/a", files={"in/x": b"\xff\xfebin"},
                                      fetch=["out/", "missing"])
        second = await client.run_once(project_image, "ls")
    assert first.output is not None and first.output.exit_code == 0, first.output
    got = {f.path: f for f in first.files}
    assert sorted(got) == ["out/a", "out/b", "out/listing"]
    assert got["out/a"].text == "42\n" and got["out/b"].content_b64 == base64.b64encode(b"\xff\xfebin").decode()
    # The image's /work is whole again for the next call (without the first call's files), though it was deleted.
    listing = (got["out/listing"].text or "").split()
    assert "calc" in listing and second.output is not None
    assert second.output.stdout.split() == [name for name in listing if name != "in"]


async def test_a_call_replays_elsewhere_when_its_worker_dies(exec_settings: KilnSettings, tmp_path: Path,
                                                             docker_engine: Any) -> None:
    first = exec_worker(exec_settings, tmp_path / "locks")
    with first:
        first.wait_assigned()
        async with KilnClient(exec_settings, "trainer") as kiln:
            call = asyncio.ensure_future(ExecClient(kiln).run_once(IMAGE, "sleep 3; echo finished", timeout_s=30))
            for _ in range(300):  # until the call runs in a runner
                if any("sleep 3" in " ".join(p[-1:]) for c in _runners(docker_engine)
                       for p in c.top()["Processes"]):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the call never started")
            first.kill()
            with exec_worker(exec_settings, tmp_path / "locks") as second:
                second.wait_assigned()
                result = await asyncio.wait_for(call, 120)
    assert result.output is not None and result.output.stdout == "finished\n"


def test_runners_of_a_dead_worker_are_reaped(exec_settings: KilnSettings, tmp_path: Path, docker_engine: Any) -> None:
    async def one_call() -> None:
        async with KilnClient(exec_settings, "trainer") as kiln:
            await ExecClient(kiln).run_once(IMAGE, "true")

    others = {c.id for c in _runners(docker_engine)}  # other workers' (alive) on this engine
    first = exec_worker(exec_settings, tmp_path / "locks")
    with first:
        first.wait_assigned()
        asyncio.run(one_call())
        leaked = {c.id for c in _runners(docker_engine)} - others
        assert leaked
        first.kill()
    with exec_worker(exec_settings, tmp_path / "locks") as second:
        second.wait_assigned()
        for _ in range(120):  # the reaper runs every second
            if not leaked & {c.id for c in _runners(docker_engine)}:
                break
            time.sleep(0.5)
    assert not leaked & {c.id for c in _runners(docker_engine)}


def _runners(docker: Any) -> list[Any]:
    return [c for c in docker.containers.list(filters={"label": "kiln.role=exec-session"})
            if c.name.startswith("kiln-r-")]


async def test_image_volumes_are_bounded_and_emptied_between_calls(exec_settings: KilnSettings, docker_engine: Any,
                                                                   one_slot_worker: WorkerProcess) -> None:
    tag = f"kiln/test-runner-volumes:{uuid.uuid4().hex[:8]}"
    docker_engine.images.build(fileobj=io.BytesIO(b"FROM kiln/base:latest\nRUN mkdir -p /data /work/cache && "
                                                  b"chown 1000:1000 /data /work/cache\nVOLUME /data /work/cache\n"),
                               tag=tag, rm=True)
    volumes = {v.name for v in docker_engine.volumes.list()}
    try:
        async with KilnClient(exec_settings, "trainer") as kiln:
            client = ExecClient(kiln)
            fill = "dd if=/dev/zero of={} bs=1M count=100 2>&1 | grep -o -e 'No space left' -e 'Read-only file sys'"
            first = await client.run_once(tag, f"{fill.format('/data/x')}; {fill.format('/work/cache/x')}; hostname",
                                          limits=SessionLimits(disk_mb=64))
            second = await client.run_once(tag, "ls -A /work/cache; hostname", limits=SessionLimits(disk_mb=64))
    finally:
        docker_engine.images.remove(tag, force=True)
    assert first.output is not None and second.output is not None
    assert first.output.stdout.splitlines()[:2] == ["Read-only file sys", "No space left"], first.output
    # The same runner served the second call (emptied, not discarded), and the volume's file is gone.
    assert second.output.stdout.split() == [first.output.stdout.split()[-1]]
    assert {v.name for v in docker_engine.volumes.list()} <= volumes  # no anonymous volume was made
