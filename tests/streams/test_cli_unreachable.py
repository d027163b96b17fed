"""Every ``kiln`` command group facing a broker it cannot reach: one or two lines saying what was tried and what to do,
a non-zero exit, no traceback and none of librdkafka's own lines (they go to the log file unless ``--verbose``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings

KILN = str(Path(sys.executable).parent / "kiln")
NOWHERE = "127.0.0.1:1"  # nothing listens on port 1
COMMANDS = [
    ["topics", "list"], ["topics", "create"], ["init"], ["worker", "echo"],
    ["replay", "echo.requests", "--from-beginning"], ["gc"], ["tail", "kiln.results"], ["status"], ["status", "serve"],
    ["dlq", "ls"], ["dlq", "show", "0", "--stage", "sleep"], ["dlq", "redrive", "--stage", "sleep", "--all"],
    ["autoscale", "run", "sleep"], ["stats", "serve"], ["builds", "submit", "some-repo"], ["builds", "failures"],
    ["saucer", "ingest", "some-repo", "/nowhere"], ["saucer", "rewrite", "b", "a", "--truncate", "HEAD"],
    ["rl", "train"], ["rl", "actor"], ["gateway", "serve"], ["demo"], ["demo", "basics"],
]
LIBRDKAFKA_LINE = re.compile(r"%\d\|\d+\.\d+\||rdkafka|FAIL\|")


def _run(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KILN, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KILN_BOOTSTRAP_SERVERS": NOWHERE, "KILN_CACHE": str(tmp),
                               "KILN_BROKER_WAIT_S": "0", **env})


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


def test_docker_and_s3_out_of_reach_are_said_with_what_to_do(kafka: KilnSettings, tmp_path: Path) -> None:
    up = {"KILN_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    docker = _run(["worker", "exec", "--slots", "1"], tmp_path, DOCKER_HOST="unix:///nonexistent/docker.sock", **up)
    s3 = _run(["gc"], tmp_path, KILN_BLOB_STORE="s3://nowhere", KILN_S3_ENDPOINT="http://127.0.0.1:1",
              KILN_S3_ACCESS_KEY="a", KILN_S3_SECRET_KEY="b", **up)
    for run, hint in ((docker, "kiln docker start"), (s3, "kiln s3 start")):
        said = run.stdout + run.stderr
        assert run.returncode != 0 and hint in said and "Traceback" not in said, said
        assert len(said.strip().splitlines()) <= 2, said
    assert "127.0.0.1:1" in s3.stderr and "nonexistent/docker.sock" in docker.stderr


@contextlib.contextmanager
def _hanging_up_listener() -> Iterator[str]:
    """An address that accepts connections and closes each at once: librdkafka logs every disconnect."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        stop = threading.Event()

        def hang_up() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    listener.accept()[0].close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(5)


def test_librdkafka_lines_go_to_the_log_file_and_to_the_terminal_only_when_asked(tmp_path: Path) -> None:
    with _hanging_up_listener() as address:
        quiet = _run(["tail", "kiln.results", "-n", "1"], tmp_path, KILN_BOOTSTRAP_SERVERS=address)
        loud = _run(["--verbose", "tail", "kiln.results", "-n", "1"], tmp_path, KILN_BOOTSTRAP_SERVERS=address)
    assert quiet.returncode != 0 and loud.returncode != 0
    said = quiet.stdout + quiet.stderr
    assert address in said and not LIBRDKAFKA_LINE.search(said) and len(said.strip().splitlines()) <= 2, said
    assert "rdkafka" in (tmp_path / "logs" / "kiln.log").read_text()
    assert LIBRDKAFKA_LINE.search(loud.stderr), loud.stderr


def _forward(listener: socket.socket, target: tuple[str, int], stop: threading.Event) -> None:
    """Accept on ``listener`` and relay each connection to ``target`` both ways."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            client = listener.accept()[0]
        except TimeoutError:
            continue
        upstream = socket.create_connection(target)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_relay, args=(a, b), daemon=True).start()


def _relay(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def test_a_worker_started_before_its_broker_waits_for_it(kafka: KilnSettings, topics) -> None:  # type: ignore[no-untyped-def]
    """A worker whose bootstrap address answers only 3 s after it started (a broker restarting) says it waits, then
    joins its group; it does not exit (a preemptible node coming back mid-restart would crash-loop)."""
    request_topic, _results = topics(partitions=1)
    port = free_port()
    host, broker_port = kafka.bootstrap_servers.rsplit(":", 1)
    late = kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{port}"})
    with WorkerProcess("echo", late, request_topic, slots=1, env={"KILN_BROKER_WAIT_S": "60"}) as worker:
        time.sleep(3)
        assert worker.proc.poll() is None and "waiting up to 60 s" in worker.log.read_text()
        stop = threading.Event()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))
            listener.listen()
            relay = threading.Thread(target=_forward, args=(listener, (host, int(broker_port)), stop), daemon=True)
            relay.start()
            try:
                worker.wait_assigned(60)
            finally:
                stop.set()
                relay.join(5)
