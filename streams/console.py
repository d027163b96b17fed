"""What a person sees from ``kiln``: librdkafka's own log lines in a log file (on the terminal only with
``--verbose``), a broker that does not answer found before a command waits on it, and every failure of a component
kiln could not reach said in one or two lines — what was tried and what to do — with a non-zero exit. Tracebacks
are for bugs only."""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from kiln.streams.errors import (
    BlobUnavailable,
    BrokerRefused,
    BrokerUnavailable,
    DockerUnavailable,
    InfraError,
    KilnError,
    MissingExtra,
)
from kiln.streams.extras import EXTRA_OF_MODULE, missing_extra
from kiln.streams.settings import KAFKA_LOGGER, KilnSettings

BROKER_FREE = {("setup",), ("stages",), ("broker",), ("s3",), ("registry",), ("docker",), ("k8s",),
               ("autoscale", "check"), ("rl", "serve"), ("rl", "report"), ("saucer", "serve"), ("saucer", "ls")}
"""Commands (their first words) that never talk to the broker: no reachability check before them."""
BROKER_HINT = "start the local one with `kiln broker start`, or set KILN_BOOTSTRAP_SERVERS (and KILN_KAFKA_CONFIG)"
S3_HINT = "start the local one with `kiln s3 start`, or check KILN_BLOB_STORE and KILN_S3_*"
DOCKER_HINT = "start the local engine with `kiln docker start`, or set DOCKER_HOST to one kiln may use"
EXIT_UNREACHABLE = 2


def log_file(settings: KilnSettings) -> Path:
    """Where a command's librdkafka lines go unless ``--verbose``."""
    return settings.cache / "logs" / "kiln.log"


def route_kafka_logs(settings: KilnSettings, verbose: bool) -> None:
    """librdkafka's lines (every Kafka client kiln makes logs through ``KAFKA_LOGGER``) to the log file, and with
    ``verbose`` to the terminal (stderr) as well."""
    logger = logging.getLogger(KAFKA_LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    if verbose:
        logger.addHandler(logging.StreamHandler(sys.stderr))
    path = log_file(settings)
    with contextlib.suppress(OSError):  # no writable cache: the lines are dropped, never shown unasked
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(message)s"))
        logger.addHandler(handler)
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


WAITS_FOR_BROKER = {("worker",)}
"""Commands that wait for the broker instead of failing: a worker started while the broker restarts (a preemptible
node coming back during a rolling upgrade) must not exit, or every such start is a crash loop."""


def waits_for_broker(argv: Sequence[str]) -> bool:
    words = [a for a in argv if not a.startswith("-")]
    return any(tuple(words[: len(prefix)]) == prefix for prefix in WAITS_FOR_BROKER)


def wait_for_broker(settings: KilnSettings) -> None:
    """``check_broker`` until it passes (a line to stderr while it waits), ``BrokerUnavailable`` after
    ``KILN_BROKER_WAIT_S``; refused credentials fail at once (waiting would not change them)."""
    limit_s = settings.broker_wait_s
    deadline = time.monotonic() + limit_s
    said = False
    while True:
        try:
            check_broker(settings)
            return
        except BrokerUnavailable as e:
            if time.monotonic() >= deadline:
                raise
            if not said:
                print(f"kiln: {e}; waiting up to {limit_s:.0f} s for it", file=sys.stderr, flush=True)
                said = True
            time.sleep(1.0)


def needs_broker(argv: Sequence[str]) -> bool:
    """Whether the command named by ``argv`` (arguments after ``kiln``) talks to the broker."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or "--help" in argv:
        return False
    return not any(tuple(words[: len(prefix)]) == prefix for prefix in BROKER_FREE)


def check_broker(settings: KilnSettings, timeout_s: float = 3.0) -> None:
    """``BrokerUnavailable`` unless some bootstrap server accepts a TCP connection within ``timeout_s`` and the
    cluster answers a metadata request within twice that; ``BrokerRefused`` when it answers but refuses kiln's
    credentials (KILN_KAFKA_CONFIG)."""
    tried = []
    for server in (s.strip() for s in settings.bootstrap_servers.split(",") if s.strip()):
        host, _, port = server.rpartition(":")
        host = host.strip("[]") or server
        try:
            with socket.create_connection((host, int(port or 9092)), timeout=timeout_s):
                break
        except (OSError, ValueError) as e:
            tried.append(f"{server} ({e.strerror if isinstance(e, OSError) and e.strerror else e})")
    else:
        raise BrokerUnavailable(f"no Kafka broker answered at {', '.join(tried) or repr(settings.bootstrap_servers)}")
    errors: list[KafkaError] = []
    admin = AdminClient(settings.kafka(error_cb=errors.append))
    try:
        admin.list_topics(timeout=2 * timeout_s)
    except KafkaException as e:
        admin.poll(0.5)  # serves the error callbacks
        refused = next((x for x in errors if x.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL)), None)
        if refused is not None:
            raise BrokerRefused(f"the broker at {settings.bootstrap_servers} refused kiln: {refused.str()}") from None
        raise BrokerUnavailable(f"the broker at {settings.bootstrap_servers} accepted a connection but answered no "
                                f"metadata request in {2 * timeout_s:.0f} s: {_kafka_reason(e)}") from None


def _docker_error(e: BaseException) -> bool:
    try:
        from docker.errors import DockerException
    except ModuleNotFoundError:
        return False
    return isinstance(e, DockerException)


def explain(e: BaseException, settings: KilnSettings, command: str) -> str | None:
    """One or two lines for a failure of ``command`` kiln expects (an unreachable or refusing component, a missing
    extra, any ``KilnError``); ``None`` for a bug, which keeps its traceback."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in EXTRA_OF_MODULE:
        return str(missing_extra(e, command))
    if isinstance(e, BrokerUnavailable) or (isinstance(e, KafkaException) and _broker_down(e)):
        detail = str(e) if isinstance(e, BrokerUnavailable) else f"the broker at {settings.bootstrap_servers} " \
            f"did not answer: {_kafka_reason(e)}"
        return f"{detail}\n  {BROKER_HINT}"
    if isinstance(e, BrokerRefused):
        return f"{e}\n  check the credentials and TLS settings in KILN_KAFKA_CONFIG"
    if isinstance(e, KafkaException):
        return f"Kafka refused the request at {settings.bootstrap_servers}: {_kafka_reason(e)}\n" \
               "  check KILN_KAFKA_CONFIG (credentials, TLS) and the topics (`kiln topics create`)"
    if isinstance(e, BlobUnavailable):
        return f"the blob store did not answer: {e}\n  {S3_HINT}"
    if isinstance(e, DockerUnavailable) or _docker_error(e):
        return f"the Docker engine did not answer: {' '.join(str(e).split())[:300]}\n  {DOCKER_HINT}"
    if isinstance(e, MissingExtra):
        return str(e)
    if isinstance(e, InfraError):
        return f"{e}\n  `kiln setup --all` installs and starts the local components"
    if isinstance(e, KilnError):
        return str(e)
    return None


def _kafka_reason(e: KafkaException) -> str:
    err = e.args[0] if e.args else None
    return err.str() if isinstance(err, KafkaError) else str(e)


def _broker_down(e: KafkaException) -> bool:
    err = e.args[0] if e.args else None
    return isinstance(err, KafkaError) and err.code() in (
        KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError._RESOLVE)


def fail(message: str) -> None:
    """Print ``message`` as kiln's error on stderr."""
    print(f"kiln: {message}", file=sys.stderr)
