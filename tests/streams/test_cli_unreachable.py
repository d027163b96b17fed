"""Every ``kiln`` command group facing a broker it cannot reach: one or two lines saying what was tried and what to do,
a non-zero exit, no traceback and none of librdkafka's own lines (they go to the log file unless ``--verbose``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.streams.settings import KilnSettings

KILN = str(Path(sys.executable).parent / "kiln")
NOWHERE = "127.0.0.1:1"  # nothing listens on port 1
COMMANDS = [
    ["topics", "list"], ["topics", "create"], ["init"], ["worker", "echo"],
    ["replay", "echo.requests", "--from-beginning"], ["gc"], ["tail", "kiln.results"], ["status"], ["status", "serve"],
    ["dlq", "ls"], ["dlq", "show", "0", "--stage", "sleep"], ["dlq", "redrive", "--stage", "sleep", "--all"],
    ["autoscale", "run", "sleep"], ["stats", "serve"], ["builds", "submit", "some-repo"], ["builds", "failures"],
    ["saucer", "ingest", "some-repo", "/nowhere"], ["saucer", "rewrite", "b", "a", "--truncate", "HEAD"],
    ["rl", "train"], ["rl", "actor"], ["gateway", "serve"], ["demo"],
]
LIBRDKAFKA_LINE = re.compile(r"%\d\|\d+\.\d+\||rdkafka|FAIL\|")


def _run(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KILN, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KILN_BOOTSTRAP_SERVERS": NOWHERE, "KILN_CACHE": str(tmp), **env})


@pytest.mark.timeout(600)
def test_every_command_group_says_what_it_tried_and_what_to_do(tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda args: (args, _run(args, tmp_path)), COMMANDS))
    for args, run in runs:
        said = run.stdout + run.stderr
        assert run.returncode != 0, (args, said)
        assert NOWHERE in said and "kiln broker start" in said and "KILN_BOOTSTRAP_SERVERS" in said, (args, said)
        assert "Traceback" not in said and not LIBRDKAFKA_LINE.search(said), (args, said)
        assert len(said.strip().splitlines()) <= 2, (args, said)


def test_a_broker_that_refuses_the_credentials_is_named_as_such(kafka: KilnSettings, tmp_path: Path) -> None:
    """The local broker's SASL listener (infra/kafka/kafka.sh: port + 2) with a user it does not know."""
    sasl = f"127.0.0.1:{int(kafka.bootstrap_servers.rsplit(':', 1)[1]) + 2}"
    credentials = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
                   "sasl.username": "nobody", "sasl.password": "wrong"}
    run = _run(["dlq", "ls"], tmp_path, KILN_BOOTSTRAP_SERVERS=sasl, KILN_KAFKA_CONFIG=json.dumps(credentials))
    said = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in said and len(said.strip().splitlines()) <= 2, said
    assert "authentication" in said.lower() and "KILN_KAFKA_CONFIG" in said and sasl in said, said


def test_librdkafka_lines_go_to_the_log_file_and_to_the_terminal_only_when_asked(tmp_path: Path) -> None:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        quiet = _run(["tail", "kiln.results", "-n", "1"], tmp_path, KILN_BOOTSTRAP_SERVERS=address)
        loud = _run(["--verbose", "tail", "kiln.results", "-n", "1"], tmp_path, KILN_BOOTSTRAP_SERVERS=address)
    assert quiet.returncode != 0 and loud.returncode != 0
    assert not LIBRDKAFKA_LINE.search(quiet.stdout + quiet.stderr), quiet.stderr
    log = (tmp_path / "logs" / "kiln.log").read_text()
    assert "rdkafka" in log or "FAIL" in log, log[-2000:]
    assert loud.stderr.count("\n") > quiet.stderr.count("\n"), loud.stderr
