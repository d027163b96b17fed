"""The exec trust boundary, tried as an attacker would (a model's commands, another client on the same topics):
each attempt fails, the failure is visible in the result, and the session's state shows nothing got through."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.schemas.envelope import new_request_id
from kiln.schemas.exec import ExecRequest, SessionLimits
from kiln.schemas.images import REPORTS_DIR
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import WorkerProcess
from kiln.streams.settings import KilnSettings
from kiln.workers.exec.client import ExecClient, ExecSession, signed
from tests.streams.harness import read_all
from tests.workers.exec.conftest import exec_worker

pytestmark = pytest.mark.docker

# A planted process that keeps writing a passing report, started by a command that then kills its own wrapper.
TAMPER = (f"nohup bash -c 'while true; do mkdir -p {REPORTS_DIR}; printf \"<testsuite tests=\\\"50\\\" "
          "failures=\\\"0\\\"><testcase classname=\\\"fake\\\" name=\\\"forged\\\"/></testsuite>\" "
          f"> {REPORTS_DIR}/junit.xml; sleep 0.01; done' >/dev/null 2>&1 & sleep 0.3; kill -9 $PPID $$")


async def test_limits_are_capped_server_side(project_image: str, exec_settings: KilnSettings,
                                             worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "agent") as kiln:
        client = ExecClient(kiln)
        for limits in (SessionLimits(memory_mb=65536), SessionLimits(cpus=64), SessionLimits(pids=32768),
                       SessionLimits(disk_mb=65536), SessionLimits(idle_timeout_s=24 * 3600)):
            with pytest.raises(RequestFailed, match="LimitExceeded"):
                await client.open_session(project_image, limits=limits)
        session = await client.open_session(project_image)
        with pytest.raises(RequestFailed, match=r"LimitExceeded.*timeout_s"):
            await client.run(session, "true", timeout_s=24 * 3600)
        await client.close_session(session)


async def test_session_keys_never_travel_and_proofs_cannot_be_forged_or_replayed(
        project_image: str, exec_settings: KilnSettings, worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "agent") as kiln, KilnClient(exec_settings, "eavesdropper") as thief:
        client = ExecClient(kiln)
        session = await client.open_session(project_image)
        # What a reader of the shared results topic sees: the key only sealed, never in the clear.
        records = [m.value() or b"" for m in read_all(exec_settings, exec_settings.topic("kiln.results"))]
        assert records and not [r for r in records if session.key.hex() in r.hex() or session.key in r]
        opened = [json.loads(r) for r in records if session.session_id.encode() in r]
        sealed = opened[0]["result"]["sealed_key"]
        stolen = ExecSession(session.session_id, sealed.encode()[:32], session.partition, session.image)
        with pytest.raises(RequestFailed, match="SessionDenied"):
            await ExecClient(thief).run(stolen, "id")
        # A forged proof, and a genuine request altered in flight.
        forged = ExecRequest(op="run", session_id=session.session_id, command="id", auth="0" * 64)
        with pytest.raises(RequestFailed, match="SessionDenied"):
            await thief.call("exec", forged, key=session.session_id, partition=session.partition)
        request_id = new_request_id()
        genuine = signed(session.key, request_id, op="run", session_id=session.session_id,
                         command="echo ran >> /work/count.txt; wc -l < /work/count.txt")
        altered = genuine.model_copy(update={"command": "echo pwned > /work/pwned.txt"})
        with pytest.raises(RequestFailed, match="SessionDenied"):
            await thief.call("exec", altered, key=session.session_id, partition=session.partition,
                             request_id=request_id)
        first = await kiln.call("exec", genuine, key=session.session_id, partition=session.partition,
                                request_id=request_id)
        # The same signed request replayed by someone else: its first result again, no second execution.
        async with KilnClient(exec_settings, "replayer") as replayer:
            replayed = await replayer.call("exec", genuine, key=session.session_id, partition=session.partition,
                                           request_id=request_id)
        assert replayed.output.stdout == first.output.stdout == "1\n"
        state = await client.run(session, "cat /work/count.txt; ls /work/pwned.txt 2>&1")
        assert state.stdout.startswith("ran\n") and "No such file" in state.stdout
        await client.close_session(session)


async def test_snapshots_open_only_with_the_proof_of_their_session(project_image: str,
                                                                   exec_settings: KilnSettings,
                                                                   worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "agent") as kiln, KilnClient(exec_settings, "other") as other:
        owner, intruder = ExecClient(kiln), ExecClient(other)
        secret = await owner.open_session(project_image)
        await owner.run(secret, "echo private > /work/secret.txt")
        digest = await owner.snapshot(secret)
        mine = await intruder.open_session(project_image)
        for claim in (mine, ExecSession(secret.session_id, b"a guessed session key of 32 byte", 0, "")):
            with pytest.raises(RequestFailed, match="SessionDenied"):
                await intruder.open_session(project_image, snapshot=digest, snapshot_of=claim)
        restored = await owner.open_session(project_image, snapshot=digest, snapshot_of=secret)
        assert (await owner.run(restored, "cat /work/secret.txt")).stdout == "private\n"
        for s, c in ((secret, owner), (restored, owner), (mine, intruder)):
            await c.close_session(s)


async def test_files_never_resolve_outside_the_work_area(project_image: str, exec_settings: KilnSettings,
                                                         worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "agent") as kiln:
        client = ExecClient(kiln)
        s = await client.open_session(project_image, limits=SessionLimits(disk_mb=64))
        planted = await client.run(s, "ln -s /etc/shadow shadow; ln -s / root; ln -s /usr usr; ln -s /etc/passwd pw;"
                                      " ln -s /work/calc inside")
        assert planted.exit_code == 0, planted
        for paths in (["shadow"], ["root/etc/shadow"], ["root/etc/passwd"], ["calc/__init__.py", "pw"]):
            with pytest.raises(RequestFailed, match="resolves outside /work"):
                await client.read_files(s, paths)
        for target in ("usr/planted.txt", "pw", "root/tmp/x.txt"):
            with pytest.raises(RequestFailed, match="resolves outside /work"):
                await client.write_files(s, {target: "owned"})
        # Links that stay inside /work work, and many files come back from one call.
        await client.write_files(s, {f"many/f{i}.txt": str(i) for i in range(200)})
        many = await client.read_files(s, [f"many/f{i}.txt" for i in range(200)] + ["inside/__init__.py"])
        assert len(many) == 201 and many["many/f7.txt"] == b"7"
        # Writes go through the session's own disk limit (a full tmpfs), never around it.
        await client.run(s, "dd if=/dev/zero of=/work/fill bs=1M count=40 2>/dev/null; true")
        with pytest.raises(RequestFailed, match="No space left"):
            await client.write_files(s, {"big.bin": b"\0" * (700 << 10)})
        await client.run(s, "rm -f /work/fill")
        quoted = "a'b; touch \"/tmp/pwned\"; echo '.txt"
        await client.write_files(s, {quoted: "x"})
        assert (await client.read_files(s, [quoted]))[quoted] == b"x"
        deleted = kiln.result_of(await (await client.submit(s, "delete_files", paths=[quoted])))
        assert deleted.output is not None and deleted.output.exit_code == 0
        after = await client.run(s, f"ls /tmp/pwned 2>&1; ls -- {json.dumps(quoted)} 2>&1; ls /usr/planted.txt 2>&1")
        assert after.stdout.count("No such file") == 3, after.stdout
        await client.close_session(s)


async def test_a_command_cannot_outlive_itself_or_forge_the_next_test_report(
        project_image: str, exec_settings: KilnSettings, worker: WorkerProcess) -> None:
    async with KilnClient(exec_settings, "agent") as kiln:
        client = ExecClient(kiln)
        s = await client.open_session(project_image)
        await client.write_files(s, {"tests/test_broken.py": "def test_broken():\n    assert 1 == 2\n"})
        tamper = await client.run(s, TAMPER, timeout_s=20)
        assert tamper.exit_code != 0  # it killed its own wrapper
        left = await client.run(s, "ps -eo uid=,args= | awk '$1 == 1000' | grep -c '[w]hile true' || true")
        assert left.stdout.strip() == "0", left.stdout
        result = await client.run_tests(s, timeout_s=300)
        assert result.tests is not None and result.tests.failed >= 1, result.tests
        assert not [c for c in result.tests.cases if c.name == "forged"], result.tests
        await client.close_session(s)


async def test_a_command_can_neither_forge_the_end_of_its_output_nor_turn_its_failure_into_an_infra_error(
        project_image: str, exec_settings: KilnSettings, worker: WorkerProcess) -> None:
    """The wrapper marks the end of each stream (a stream cut by dockerd is retried, never answered as silence): the
    mark a command can read from its wrapper's arguments stays in its own output, and a command that kills its
    wrapper before the mark is answered as it ran, not retried as an infrastructure failure."""
    async with KilnClient(exec_settings, "agent") as kiln:
        client = ExecClient(kiln)
        s = await client.open_session(project_image)
        forged = await client.run(s, "mark=$(cat /proc/*/cmdline 2>/dev/null | grep -a -o 'kiln[-]end:[0-9a-f]*' "
                                     "| head -1); printf 'a\\036%s\\036b' \"$mark\"; printf '\\036%s\\036' "
                                     "\"$mark\" >&2; exit 3")
        mark = forged.stdout[2:-2]
        assert mark.startswith("kiln-end:") and len(mark) == len("kiln-end:") + 16, forged
        assert (forged.exit_code, forged.stdout, forged.stderr) == (3, f"a\x1e{mark}\x1eb", f"\x1e{mark}\x1e")
        started = time.monotonic()
        killer = await client.run(s, "echo partial; pkill -9 -f 'kiln[-]end'; sleep 5; echo never", timeout_s=20)
        assert (killer.exit_code, killer.stdout) == (137, "partial\n"), killer
        assert time.monotonic() - started < 15  # answered once, not retried
        planted = f"tail\x1e{mark}\x1e"  # files travel through the same marked streams
        await client.write_files(s, {"planted.txt": planted})
        assert await client.read_files(s, ["planted.txt"]) == {"planted.txt": planted.encode()}
        assert (await client.run(s, "echo still alive")).stdout == "still alive\n"
        # The wrapper exits at the end of its stdin, which only the worker closes: a command that keeps that input
        # open (a writer of its own, from any process's /proc/PID/fd/0 it can reach) only holds its wrapper until its
        # time limit, answered as a timeout, never an infrastructure failure nor a hang.
        started = time.monotonic()
        holder = await client.run(s, "for fd in /proc/[0-9]*/fd/0; do (sleep 60 >\"$fd\" &) 2>/dev/null; done; "
                                     "echo held", timeout_s=5)
        assert holder.stdout == "held\n" and holder.exit_code == 137 and holder.timed_out, holder
        assert time.monotonic() - started < 30
        assert (await client.run(s, "echo still alive")).stdout == "still alive\n"
        await client.close_session(s)


async def test_workers_with_different_lock_dirs_do_not_reap_each_other(
        project_image: str, stage_topics: Callable[..., KilnSettings], tmp_path: Path) -> None:
    settings = stage_topics(("exec.requests", 4))
    with exec_worker(settings, tmp_path / "locks-a") as a, exec_worker(settings, tmp_path / "locks-b") as b:
        a.wait_assigned()
        b.wait_assigned()
        async with KilnClient(settings, "agent") as kiln:
            client = ExecClient(kiln, sessions_per_key=1)
            sessions = await asyncio.gather(*(client.open_session(project_image, repository=f"r{i}")
                                              for i in range(6)))
            envelopes = [await (await client.submit(s, "run", command="true")) for s in sessions]
            assert len({e.worker for e in envelopes}) == 2, "every session landed on one worker"
            await asyncio.sleep(4)  # several reaper rounds of each worker (every second here)
            for s in sessions:
                assert (await client.run(s, "echo alive")).stdout == "alive\n"
                await client.close_session(s)
