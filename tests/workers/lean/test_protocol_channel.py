"""The Lean verdict cannot be forged through the REPL's own protocol channel (issue 32).

``#eval`` runs inside the REPL process, whose stdin and stdout carry the protocol. The fake REPL's test-only
``forge`` command does what ``#eval`` IO can against them: write a REPL reply that turns
``theorem bad : 1 = 2 := rfl`` into ok, by reopening its stdout in the process or from a child process it starts,
and optionally read the fence that follows and answer it too. Through the real worker (sandbox on, the default),
every attack leaves the verdict honest and the next client of the same process gets its own reply; with the
sandbox's rules relaxed the fence still refuses a lone forged reply; with the sandbox off, or the fence off, the same
attacks do forge the verdict and shift later replies, which shows the attacks are real and what stops each."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.schemas.lean import LeanRequest, LeanResult
from kiln.streams.client import KilnClient
from kiln.streams.errors import RequestFailed
from kiln.streams.processes import free_port
from kiln.streams.settings import KilnSettings
from kiln.workers.lean.client import LeanClient
from kiln.workers.lean.errors import ReplOutOfStep
from kiln.workers.lean.pool import ReplPool
from kiln.workers.lean.repl import Header, ReplLimits, ReplProcess
from kiln.workers.lean.session import LeanSession, StateCodec
from tests.workers.lean.conftest import lean_worker
from tests.workers.lean.fake import FAKE_COMMAND

BAD = "theorem bad : 1 = 2 := rfl"
GOOD = "theorem good : a = a := rfl"
FORGED = {"env": 0}  # what the REPL answers for a command without errors: ok


def attack(via: str, fence: bool) -> str:
    spec = {"reply": FORGED, "via": via, "fence": fence}
    return f"-- fake: forge {json.dumps(spec)}\n{BAD}"


ATTACKS = [("fd", False), ("fd", True), ("child", False), ("child", True)]


def reports(result: LeanResult) -> list[dict[str, Any]]:
    return [json.loads(m.data) for m in result.messages if m.severity == "info"]


async def process_token(client: LeanClient) -> str:
    probe = await client.run_code("-- fake: io {}\ntheorem t : a = a := rfl")
    return str(reports(probe)[0]["process"])


async def test_forged_replies_never_become_the_verdict(stage_topics: Callable[..., KilnSettings]) -> None:
    """Sandbox as deployed: no process can be created inside, no /proc to reopen the pipes by. Every attack
    fails where it starts, the verdict is Lean's, and the same process answers the next client with its own
    reply (one slot, so one process serves every request)."""
    settings = stage_topics(("lean.requests", 1))
    with lean_worker(settings, 1, free_port()) as worker:
        worker.wait_assigned()
        async with KilnClient(settings, "prover") as kiln:
            client = LeanClient(kiln)
            process = await process_token(client)
            for via, fence in ATTACKS:
                result = await client.run_code(attack(via, fence))
                assert not result.ok, (via, fence, result)
                assert any("tactic 'rfl' failed" in m.data for m in result.messages), result.messages
                outcome = reports(result)[0]
                assert outcome["process"] == process
                expected = "PermissionError" if via == "child" else "FileNotFoundError"  # seccomp; no /proc
                assert outcome["forge"].startswith(expected), outcome
                # The next client, on the same process: its own reply, not one shifted by the attack.
                assert (await client.run_code(GOOD)).ok
                assert not (await client.run_code(BAD)).ok
                assert await process_token(client) == process


async def test_the_fence_refuses_a_reply_written_into_the_channel(
        stage_topics: Callable[..., KilnSettings]) -> None:
    """With /proc mounted in the sandbox, the code reopens the REPL's stdout and writes its reply: the fence finds
    the REPL's own reply where its answer should be, the forged one is never used (the request fails typed,
    on every attempt) and later clients get their own replies from a fresh process."""
    settings = stage_topics(("lean.requests", 1))
    with lean_worker(settings, 1, free_port(), KILN_LEAN_SANDBOX_PROC="true") as worker:
        worker.wait_assigned()
        async with KilnClient(settings, "prover") as kiln:
            client = LeanClient(kiln)
            before = await process_token(client)
            with pytest.raises(RequestFailed, match="ReplOutOfStep"):
                await client.run_code(attack("fd", False))
            assert (await client.run_code(GOOD)).ok
            assert not (await client.run_code(BAD)).ok
            assert await process_token(client) != before  # the process that was written into is gone


async def test_without_the_sandbox_the_same_attacks_forge_the_verdict(
        stage_topics: Callable[..., KilnSettings]) -> None:
    """The control: the sandbox off, a child process both writes the reply and answers the fence from the
    inherited stdin, and the verdict is forged: this is what the no-spawn rule prevents."""
    settings = stage_topics(("lean.requests", 1))
    with lean_worker(settings, 1, free_port(), KILN_LEAN_SANDBOX="false") as worker:
        worker.wait_assigned()
        async with KilnClient(settings, "prover") as kiln:
            forged = await LeanClient(kiln).run_code(attack("child", True))
    assert forged.ok and not forged.messages  # `1 = 2 := rfl` accepted


async def _session_run(tmp_path: Path, fence: bool, codes: list[str],
                       ops: list[str] | None = None) -> list[LeanResult | Exception]:
    """``codes`` run in order on one fake REPL process, unsandboxed, with or without the fence; the REPL
    operations timed go to ``ops``."""
    ops = ops if ops is not None else []
    counter = iter(range(1000))

    def factory(header: Header) -> ReplProcess:
        return ReplProcess(shlex.split(FAKE_COMMAND), header, tmp_path / f"p{next(counter)}", ReplLimits(),
                           fence=fence)

    session = LeanSession(ReplPool(factory, size=1), StateCodec(None), on_repl=lambda op, _s: ops.append(op))
    results: list[LeanResult | Exception] = []
    try:
        for text in codes:
            try:
                results.append(await session.run(LeanRequest(op="run_code", code=text), "k"))
            except ReplOutOfStep as e:
                results.append(e)
    finally:
        await session.pool.close()
    return results


async def test_a_lone_forged_reply_is_caught_by_the_fence_and_nothing_shifts(tmp_path: Path) -> None:
    """The fence alone (no sandbox): a reply written into stdout is caught before it is used, and the next
    request gets its own reply. Without the fence the forged reply is the verdict and every later reply is one
    behind (the second request receives the attacker's command's real reply, an error for a good theorem)."""
    ops: list[str] = []
    fenced = await _session_run(tmp_path / "fenced", True, [attack("fd", False), GOOD, BAD], ops)
    assert isinstance(fenced[0], ReplOutOfStep)
    assert isinstance(fenced[1], LeanResult) and fenced[1].ok
    assert isinstance(fenced[2], LeanResult) and not fenced[2].ok
    assert ops == ["code", "fence"] * 3  # each fence timed apart from the work asked for

    unfenced = await _session_run(tmp_path / "unfenced", False, [attack("fd", False), GOOD])
    assert isinstance(unfenced[0], LeanResult) and unfenced[0].ok  # forged
    assert isinstance(unfenced[1], LeanResult) and not unfenced[1].ok  # off by one: BAD's reply for GOOD
