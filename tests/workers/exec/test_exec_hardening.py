"""Exec sessions against what a hostile image or a replaying client can do (issue 32): image labels imitating
kiln's, image-declared volumes, a captured request replayed after a hand-over, and the replay cache's memory."""

from __future__ import annotations

import asyncio
import contextlib
import io
import shlex
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from docker.errors import APIError, NotFound

from kiln.schemas.envelope import new_request_id, request_id_value
from kiln.schemas.exec import CommandOutput, ExecResult, SessionLimits
from kiln.streams.blobstore import open_blob_store
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.settings import KilnSettings
from kiln.workers.common.liveness import namespace, owner_alive
from kiln.workers.exec.client import ExecClient, signed
from kiln.workers.exec.errors import SessionDenied
from kiln.workers.exec.sessions import (
    Capture,
    EndMark,
    LabelSeal,
    Session,
    SessionManager,
    cut_by_dockerd,
    result_bytes,
)
from tests.workers.exec.conftest import exec_worker, session_containers

BASE = "kiln/base:latest"  # a shell is all these sessions need


def _session(max_bytes: int) -> Session:
    return Session(id=uuid.uuid4().hex, key=b"k" * 32, client_id="c", image="kiln/x", limits=SessionLimits(),
                   container=None, volumes=[], keeper_pid=0, init_pid=0, max_bytes=max_bytes)


def _ulid(value: int) -> str:
    return "".join("0123456789ABCDEFGHJKMNPQRSTVWXYZ"[(value >> shift) & 31] for shift in range(125, -1, -5))


def _result(stdout_bytes: int) -> ExecResult:
    return ExecResult(op="run", session_id="s", output=CommandOutput(exit_code=0, stdout="x" * stdout_bytes))


# --- the replay cache: bounded in bytes, every forgotten id refused -----------------------------------------------


def test_replay_cache_is_bounded_in_bytes_and_refuses_what_it_forgot() -> None:
    one = result_bytes(_result(10_000))
    session = _session(max_bytes=5 * one)
    ids = [new_request_id() for _ in range(12)]
    for rid in ids:
        session.remember(rid, _result(10_000))
    assert len(session.results) == 5 and session.cached_bytes == 5 * one <= session.max_bytes
    assert list(session.results) == ids[-5:]
    for rid in ids[:-5]:  # forgotten: a replay is refused, never run again
        with pytest.raises(SessionDenied):
            session.answered(rid)
    assert session.answered(ids[-1]) == _result(10_000)  # remembered: its first result
    assert session.answered(new_request_id()) is None  # a new request runs
    # A result larger than the whole bound is not kept, and its replay is refused too.
    big = new_request_id()
    session.remember(big, _result(10 * one))
    assert big not in session.results and session.cached_bytes <= session.max_bytes
    with pytest.raises(SessionDenied):
        session.answered(big)


def test_ids_issued_in_one_millisecond_are_told_apart() -> None:
    """Pipelined ids often share their millisecond: forgetting one must not refuse a later one not yet run."""
    ms = (request_id_value(new_request_id()) or 0) >> 80
    ids = [_ulid((ms << 80) | (i << 40)) for i in range(50)]  # as new_request_id issues them within one ms
    session = _session(max_bytes=1 << 20)
    session.remember(ids[0], _result(10))
    session.forget_oldest()
    with pytest.raises(SessionDenied):
        session.answered(ids[0])
    assert all(session.answered(rid) is None for rid in ids[1:])


def test_hand_over_watermark_covers_every_result_not_carried() -> None:
    session = _session(max_bytes=1 << 30)
    ids = [new_request_id() for _ in range(300)]
    for rid in ids:
        session.remember(rid, _result(10))
    forgotten, carried = session.handover_state(keep=256)
    assert [rid for rid, _ in carried] == ids[-256:]
    assert forgotten == request_id_value(ids[43])  # the newest of those left behind
    successor = _session(max_bytes=1 << 30)
    successor.forgotten = forgotten
    for rid, result in carried:
        successor.remember(rid, result)
    for rid in ids[:44]:
        with pytest.raises(SessionDenied):
            successor.answered(rid)
    assert successor.answered(ids[44]) is not None and successor.answered(new_request_id()) is None


def test_replay_caches_of_all_sessions_are_bounded_together() -> None:
    one = result_bytes(_result(10_000))
    manager = SessionManager(None, "exec-test", None, ["kiln/"], replay_bytes=100 * one, replay_total_bytes=8 * one)
    sessions = [manager._register(_session(max_bytes=100 * one)) for _ in range(3)]
    for session in sessions:
        for _ in range(6):
            with session.lock:
                session.remember(new_request_id(), _result(10_000))
    assert manager.replay_bytes_held() <= 8 * one
    assert all(s.cached_bytes > 0 for s in sessions)  # the largest gave way first, no session was emptied


# --- labels: only what kiln sealed is trusted ---------------------------------------------------------------------


def test_a_seal_binds_kiln_labels_to_their_container(tmp_path: Path) -> None:
    seal = LabelSeal.load(tmp_path / "locks")
    assert (tmp_path / "locks" / ".kiln-seal-key").stat().st_mode & 0o777 == 0o600
    assert LabelSeal.load(tmp_path / "locks").holds("kiln-x-1", seal.seal("kiln-x-1", {"kiln.role": "exec-session"}))
    labels = seal.seal("kiln-x-1", {"kiln.role": "exec-session", "kiln.worker": "exec-a"})
    assert seal.recorded("kiln-x-1", labels) == {"kiln.role": "exec-session", "kiln.worker": "exec-a"}
    assert not seal.holds("kiln-build-1", labels)  # the same labels on another container
    assert not seal.holds("kiln-x-1", {**labels, "kiln.worker": "exec-b"})
    assert not LabelSeal.load(tmp_path / "other").holds("kiln-x-1", labels)  # another host's secret
    # An image label the seal does not cover is not reported as kiln's.
    assert "kiln.lock" not in (seal.recorded("kiln-x-1", {**labels, "kiln.lock": "/etc/passwd"}) or {})


def test_only_unheld_lock_files_are_removed(tmp_path: Path) -> None:
    victim, hidden, stale = tmp_path / "host-file.txt", tmp_path / ".kiln-seal-key", tmp_path / "exec-gone.lock"
    for path in (victim, hidden, stale):
        path.write_text("")
    assert owner_alive(victim) and victim.exists()
    assert owner_alive(hidden) and hidden.exists()
    assert not owner_alive(stale) and not stale.exists()


def _image(docker_engine: Any, tag: str, dockerfile: str, labels: dict[str, str] | None = None) -> str:
    docker_engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, labels=labels or {}, rm=True)
    return tag


@pytest.mark.docker
async def test_reaper_leaves_containers_with_forged_kiln_labels_alone(
        exec_settings: KilnSettings, docker_engine: Any, tmp_path: Path) -> None:
    locks = (tmp_path / "locks").resolve()
    victim = tmp_path / "host-file.txt"
    victim.write_text("must survive")
    tag = f"kiln-test/forged-labels:{uuid.uuid4().hex[:8]}"
    forged: list[Any] = []
    with exec_worker(exec_settings, locks, KILN_EXEC_MAX_SESSION_AGE_S="1", KILN_EXEC_SEAL_DIR=str(locks)) as worker:
        worker.wait_assigned()
        decoy = locks / "exec-gone.lock"  # an unheld lock in the lock dir, named by a forged label
        decoy.write_text("")
        # What a repository's Dockerfile can declare; Docker merges it into every container of the image, as a
        # build container of it would be.
        cases = [{"kiln.lock": str(victim), "kiln.worker": "exec-gone"},
                 {"kiln.lock": str(decoy), "kiln.worker": "exec-gone",
                  "kiln.sealed": "kiln.lock,kiln.lockns,kiln.role,kiln.worker", "kiln.seal": "0" * 64},
                 {"kiln.lock": str(victim), "kiln.worker": "exec-gone", "kiln.lockns": "elsewhere"}]
        try:
            for i, case in enumerate(cases):
                image = _image(docker_engine, f"{tag}-{i}", f"FROM {BASE}\n",
                               {"kiln.role": "exec-session", "kiln.lockns": namespace(), **case})
                forged.append(docker_engine.containers.run(image, ["sleep", "infinity"], detach=True,
                                                           name=f"kiln-build-{uuid.uuid4().hex[:12]}",
                                                           network_mode="none"))
            # Positive controls, made after them: kiln-sealed containers of a dead worker, and of one it cannot
            # see -- the reaper removes those, so once they are gone it has judged the forged ones too.
            seal = LabelSeal.load(locks)
            controls = []
            for lockns in (namespace(), "elsewhere"):
                name = f"kiln-x-{uuid.uuid4().hex[:16]}"
                labels = seal.seal(name, {"kiln.role": "exec-session", "kiln.worker": "exec-dead",
                                          "kiln.lock": str(locks / "exec-dead.lock"), "kiln.lockns": lockns})
                controls.append(docker_engine.containers.run(BASE, ["sleep", "infinity"], name=name,
                                                             detach=True, network_mode="none", labels=labels).id)
            deadline = time.monotonic() + 60
            while {c.id for c in session_containers(docker_engine)} & set(controls):
                assert time.monotonic() < deadline, "the reaper did not remove kiln's own dead containers"
                await asyncio.sleep(0.5)
            assert victim.read_text() == "must survive" and decoy.exists()
            for container in forged:
                container.reload()
                assert container.status == "running", container.name
        finally:
            for container in forged:
                with contextlib.suppress(NotFound):  # a reaper fooled by the labels removed it already
                    container.remove(force=True)
            for i in range(len(cases)):
                docker_engine.images.remove(f"{tag}-{i}", force=True)


# --- image-declared volumes ---------------------------------------------------------------------------------------


@pytest.mark.docker
async def test_image_volumes_add_no_disk_and_leave_no_volume(exec_settings: KilnSettings, docker_engine: Any,
                                                             tmp_path: Path) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    image = _image(docker_engine, f"kiln/test-volumes:{uuid.uuid4().hex[:8]}",
                   f"FROM {BASE}\n"
                   f"RUN mkdir -p /data /work/cache && touch /data/{marker} /work/cache/{marker} && "
                   "chown -R 1000:1000 /data /work/cache\n"
                   "VOLUME /data /work/cache\n")

    def leaked() -> list[str]:  # anonymous volumes filled from this image (Docker copies its content in)
        return [v.name for v in docker_engine.volumes.list()
                if (Path(v.attrs["Mountpoint"]) / marker).exists()]

    try:
        with exec_worker(exec_settings, tmp_path / "locks") as worker:
            worker.wait_assigned()
            async with KilnClient(exec_settings, "agent") as kiln:
                client = ExecClient(kiln)
                s = await client.open_session(image, limits=SessionLimits(disk_mb=64))
                mounted = [c for c in session_containers(docker_engine) if c.image.tags == [image]]
                assert len(mounted) == 1
                names = [m.get("Name") for m in mounted[0].attrs["Mounts"] if m["Type"] == "volume"]
                assert names and all(str(n).startswith(f"{mounted[0].name}-") for n in names)  # kiln's, bounded
                outside = await client.run(s, "dd if=/dev/zero of=/data/fill bs=1M count=120 2>&1", timeout_s=60)
                assert outside.exit_code != 0 and "Read-only file system" in outside.stdout, outside
                inside = await client.run(s, "ls /work/cache; dd if=/dev/zero of=/work/cache/fill bs=1M count=120 "
                                             "2>&1; df -m /work /tmp /work/cache | awk 'NR > 1 {s += $2} END "
                                             "{print \"total\", s}'", timeout_s=60)
                assert marker in inside.stdout and "No space left on device" in inside.stdout, inside
                total = int(inside.stdout.split("total ")[-1])
                assert total <= 64, inside.stdout  # the declared volume is carved out of the session's budget
                await client.close_session(s)
            # None but kiln's own (the warm pool's container for this image, refilled after the open) ...
            assert [v for v in leaked() if not v.startswith("kiln-x-")] == []
            assert [v for v in names if docker_engine.volumes.list(filters={"name": v})] == []
            assert worker.terminate() == 0
        # ... and nothing once the worker has stopped.
        assert leaked() == []
        assert [c for c in session_containers(docker_engine) if c.image.tags == [image]] == []
    finally:
        docker_engine.images.remove(image, force=True)


# --- replays across a hand-over -----------------------------------------------------------------------------------


@pytest.mark.docker
async def test_replay_after_hand_over_never_runs_twice(docker_engine: Any,
                                                       stage_topics: Callable[..., KilnSettings],
                                                       tmp_path: Path) -> None:
    settings = stage_topics(("exec.requests", 1))
    command = "echo ran >> /work/count.txt; wc -l < /work/count.txt"
    with exec_worker(settings, tmp_path / "locks-a") as first:
        first.wait_assigned()
        async with KilnClient(settings, "agent") as kiln, KilnClient(settings, "replayer") as replayer:
            client = ExecClient(kiln)
            session = await client.open_session(BASE)
            captured = []  # what a reader of exec.requests sees: envelope, request id, proof
            futures = []
            for _ in range(300):  # more than a hand-over carries (256)
                request_id = new_request_id()
                request = signed(session.key, request_id, op="run", session_id=session.session_id,
                                 command=command)
                captured.append((request_id, request))
                futures.append(await kiln.submit("exec", request, key=session.session_id,
                                                 partition=session.partition, request_id=request_id))
            firsts = [kiln.result_of(await f).output.stdout for f in futures]
            assert firsts[0] == "1\n" and firsts[-1] == "300\n"
            with exec_worker(settings, tmp_path / "locks-b") as second:
                assert first.terminate() == 0  # graceful: the partition leaves it, the session is handed over
                second.wait_assigned()  # the only partition, now its
                for i in (0, 10, 43):  # left behind at the hand-over: refused, never run again
                    request_id, request = captured[i]
                    with pytest.raises(RequestFailed, match="SessionDenied"):
                        await replayer.call("exec", request, key=session.session_id, partition=session.partition,
                                            request_id=request_id)
                for i in (44, 200, 299):  # carried over: answered by their first result
                    request_id, request = captured[i]
                    again = await replayer.call("exec", request, key=session.session_id,
                                                partition=session.partition, request_id=request_id)
                    assert again.output.stdout == firsts[i] == f"{i + 1}\n"
                after = await client.run(session, "wc -l < /work/count.txt")
                assert after.stdout == "300\n"  # the hand-over kept the state; no replay ran a second time
                await client.close_session(session)


@pytest.mark.docker
async def test_a_result_past_the_replay_cache_is_refused_on_replay(docker_engine: Any, exec_settings: KilnSettings,
                                                                   tmp_path: Path) -> None:
    with exec_worker(exec_settings, tmp_path / "locks", KILN_EXEC_REPLAY_CACHE_BYTES="8192") as worker:
        worker.wait_assigned()
        async with KilnClient(exec_settings, "agent") as kiln, KilnClient(exec_settings, "replayer") as replayer:
            client = ExecClient(kiln)
            session = await client.open_session(BASE)
            sent = []
            for command in ("head -c 20000 /dev/zero | tr '\\0' x; echo ran >> /work/count.txt",
                            "echo small; echo ran >> /work/count.txt"):
                request_id = new_request_id()
                request = signed(session.key, request_id, op="run", session_id=session.session_id,
                                 command=command, max_output_bytes=65536)
                first = await kiln.call("exec", request, key=session.session_id, partition=session.partition,
                                        request_id=request_id)
                sent.append((request_id, request, first))
            (big_id, big, _), (small_id, small, small_first) = sent
            with pytest.raises(RequestFailed, match="SessionDenied"):  # not kept (too large): refused
                await replayer.call("exec", big, key=session.session_id, partition=session.partition,
                                    request_id=big_id)
            again = await replayer.call("exec", small, key=session.session_id, partition=session.partition,
                                        request_id=small_id)
            assert again.output.stdout == small_first.output.stdout == "small\n"
            assert (await client.run(session, "wc -l < /work/count.txt")).stdout == "2\n"
            await client.close_session(session)


def test_a_stream_dockerd_cut_short_is_told_from_a_silent_command() -> None:
    """dockerd can close an attached exec stream before the last output of a quick command (moby#27289): the
    wrapper's end mark, split across chunks or past the output cap, tells a whole stream from a cut one."""
    end = EndMark()
    whole = Capture(4, end.mark)
    for chunk in (b"abcdef", end.mark[:3], end.mark[3:7], end.mark[7:], b"late"):
        whole.feed(chunk)
    assert whole.output() == (b"abcd", True) and whole.ended
    short = Capture(64, end.mark)
    for chunk in (b"ok\n", end.mark[:-1], end.mark, b"!"):
        short.feed(chunk)
    assert short.output() == (b"ok\n" + end.mark[:-1] + b"!", False)
    cut = Capture(64, end.mark)
    assert cut.output() == (b"", False) and not cut.ended
    assert cut_by_dockerd(0, whole, cut) and cut_by_dockerd(1, cut, cut)
    assert not cut_by_dockerd(0, whole, short)
    # A wrapper killed by a signal never printed its mark: that answer stands as it arrived.
    assert not cut_by_dockerd(137, whole, cut) and not cut_by_dockerd(None, cut, cut)


# What fills every buffer between a command and a worker that has stopped reading: its stdout non-blocking, lines
# written until nothing more goes in for a second (or 3 MiB, within the output cap); blocking again; the bytes
# written on stderr.
FILL = """import fcntl, os, sys, time
flags = fcntl.fcntl(1, fcntl.F_GETFL)
fcntl.fcntl(1, fcntl.F_SETFL, flags | os.O_NONBLOCK)
written, last = 0, time.monotonic()
while written < 3 << 20 and time.monotonic() - last < 1:
    try:
        written += os.write(1, b"x" * 3999 + b"\\n")
        last = time.monotonic()
    except BlockingIOError:
        time.sleep(0.01)
fcntl.fcntl(1, fcntl.F_SETFL, flags)
print(written, file=sys.stderr)
"""


async def _running(docker_engine: Any, process: str) -> Any:
    """The session container in which ``process`` (a unique command line) runs, once it does."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(APIError):  # containers (other tests' too) come and go while they are listed
            for container in docker_engine.containers.list(filters={"label": "kiln.role=exec-session"}, sparse=True):
                with contextlib.suppress(APIError):
                    if any(process in row[-1] for row in container.top()["Processes"]):
                        return container
        assert time.monotonic() < deadline, f"no session container runs {process!r}"
        await asyncio.sleep(0.05)


@pytest.mark.docker
async def test_a_stalled_worker_loses_no_output_to_dockerd(docker_engine: Any, exec_settings: KilnSettings,
                                                           tmp_path: Path) -> None:
    """dockerd gives an exec's output at most 2 s past the process's exit, then closes its streams (moby#27289). A
    worker that cannot read for longer (starved under load; stopped here) while a command's output fills every
    buffer between them lost the tail, end mark included: the command was answered ``InfraError`` ("dockerd closed
    the command's output stream early"), every time. Its wrapper now exits only once the worker has read its marks."""
    with exec_worker(exec_settings, tmp_path / "locks") as worker:
        worker.wait_assigned()  # (the output comes back as a claim check: the worker's store is the client's)
        async with KilnClient(exec_settings, "agent", blob_store=open_blob_store(exec_settings)) as kiln:
            client = ExecClient(kiln)
            s = await asyncio.wait_for(client.open_session(BASE), 60)
            pending = await client.submit(s, "run", command=f"sleep 2.3172; python3 -c {shlex.quote(FILL)}",
                                          timeout_s=30, max_output_bytes=4 << 20)
            await _running(docker_engine, "sleep 2.3172")  # the worker is reading the command's streams
            worker.proc.send_signal(signal.SIGSTOP)
            try:  # the command fills the buffers within ~3.5 s and exits; dockerd would cut 2 s later
                await asyncio.sleep(9)
            finally:
                worker.proc.send_signal(signal.SIGCONT)
            output = kiln.result_of(await asyncio.wait_for(pending, 60)).output
            assert output is not None and output.exit_code == 0, output
            written = int(output.stderr)
            assert written > 1 << 20 and len(output.stdout) == written and not output.stdout_truncated
            assert (await asyncio.wait_for(client.run(s, "echo next"), 60)).stdout == "next\n"
            await asyncio.wait_for(client.close_session(s), 60)


@pytest.mark.docker
async def test_a_session_whose_container_dies_mid_command_is_lost(docker_engine: Any, exec_settings: KilnSettings,
                                                                  tmp_path: Path) -> None:
    """A session container killed under a command (its engine, a reaper) is a lost session, not the command's exit
    137 nor an infrastructure error to retry: the client opens another."""
    with exec_worker(exec_settings, tmp_path / "locks") as worker:
        worker.wait_assigned()
        async with KilnClient(exec_settings, "agent") as kiln:
            client = ExecClient(kiln)
            s = await asyncio.wait_for(client.open_session(BASE), 60)
            pending = await client.submit(s, "run", command="echo started; sleep 30.4183", timeout_s=60)
            (await _running(docker_engine, "sleep 30.4183")).kill()
            with pytest.raises(RequestFailed, match="SessionLost"):
                kiln.result_of(await asyncio.wait_for(pending, 30))
            with pytest.raises(RequestFailed, match="SessionLost"):
                await asyncio.wait_for(client.run(s, "echo again"), 60)
