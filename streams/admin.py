"""Topic topology: every stage's request, result and dead-letter topics with their partition counts and configs."""

from __future__ import annotations

from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient, NewTopic

from streams.errors import InfraError
from streams.settings import KilnSettings


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


# Keep forever: replaying it from offset 0 rebuilds a derived store.
REPLAYABLE = {"retention.ms": "-1", "retention.bytes": "-1"}
WEEK = {"retention.ms": str(7 * 24 * 3600 * 1000)}


def _stage(request: str, partitions: int, result: str | None, result_partitions: int,
           request_config: dict[str, str] | None = None) -> list[TopicSpec]:
    specs = [
        TopicSpec(request, partitions, request_config or WEEK),
        # Dead letters are evidence: keep them until an operator has looked.
        TopicSpec(f"{request}.dlq", 1, REPLAYABLE),
    ]
    if result:
        specs.append(TopicSpec(result, result_partitions, WEEK))
    return specs


STAGE_TOPICS: list[TopicSpec] = [
    *_stage("repo.ingest", 8, "repo.events", 4, REPLAYABLE),
    *_stage("image.build", 8, "image.events", 4),
    *_stage("exec.requests", 32, "exec.results", 16),
    *_stage("lean.requests", 32, "lean.results", 16),
    *_stage("rollouts", 8, "policy.updates", 1),
    *_stage("echo.requests", 8, "kiln.results", 16),
    *_stage("sleep.requests", 16, None, 0),
]


def admin_client(settings: KilnSettings) -> AdminClient:
    return AdminClient({"bootstrap.servers": settings.bootstrap_servers})


def create_topics(settings: KilnSettings, specs: list[TopicSpec] | None = None,
                  timeout: float = 30.0) -> dict[str, str]:
    """Create missing topics (prefixed by settings); returns name -> 'created' | 'exists'."""
    admin = admin_client(settings)
    wanted = [
        NewTopic(settings.topic(s.name), num_partitions=s.partitions, replication_factor=-1, config=s.config)
        for s in (specs if specs is not None else STAGE_TOPICS)
    ]
    existing = set(admin.list_topics(timeout=timeout).topics)
    outcome = {t.topic: "exists" for t in wanted if t.topic in existing}
    todo = [t for t in wanted if t.topic not in existing]
    if todo:
        for name, fut in admin.create_topics(todo, operation_timeout=timeout).items():
            try:
                fut.result(timeout)
                outcome[name] = "created"
            except Exception as e:
                if "TOPIC_ALREADY_EXISTS" in str(e):
                    outcome[name] = "exists"
                else:
                    raise InfraError(f"creating topic {name}: {e}") from e
    return outcome


def wait_for_broker(settings: KilnSettings, timeout: float = 60.0) -> int:
    """Block until the cluster answers a metadata request; returns the broker count."""
    try:
        md = admin_client(settings).list_topics(timeout=timeout)
    except Exception as e:
        raise InfraError(f"no Kafka broker at {settings.bootstrap_servers}: {e}") from e
    return len(md.brokers)


CONSUMER_GROUP_HEARTBEAT_API = 68  # KIP-848
SHARE_GROUP_HEARTBEAT_API = 76  # KIP-932


def broker_api_keys(bootstrap_servers: str, timeout: float = 10.0) -> set[int]:
    """The API keys the first bootstrap broker supports, from a raw ApiVersions v0 request.

    librdkafka does not expose ApiVersions to Python; kiln needs it to choose the group protocol and to refuse
    share-group mode on brokers (Redpanda) that lack it.
    """
    import socket
    import struct

    host, _, port = bootstrap_servers.split(",")[0].strip().rpartition(":")
    client_id = b"kiln-probe"
    body = struct.pack(">hhih", 18, 0, 1, len(client_id)) + client_id
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            size = struct.unpack(">i", _recv_exact(sock, 4))[0]
            data = _recv_exact(sock, size)
    except OSError as e:
        raise InfraError(f"ApiVersions probe of {bootstrap_servers} failed: {e}") from e
    _corr, error, count = struct.unpack(">ihi", data[:10])
    if error:
        raise InfraError(f"ApiVersions error {error} from {bootstrap_servers}")
    return {struct.unpack(">hhh", data[10 + 6 * i: 16 + 6 * i])[0] for i in range(count)}


def _recv_exact(sock: object, n: int) -> bytes:
    import socket

    assert isinstance(sock, socket.socket)
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return bytes(buf)


def resolve_group_protocol(settings: KilnSettings) -> str:
    """'consumer' (KIP-848) where the broker supports it, else 'classic'; an explicit setting wins."""
    if settings.group_protocol != "auto":
        return settings.group_protocol
    return "consumer" if CONSUMER_GROUP_HEARTBEAT_API in broker_api_keys(settings.bootstrap_servers) else "classic"
