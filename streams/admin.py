"""Creating and deleting topics (the topology comes from the registered stage specs), and the broker feature probe."""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from kiln.streams.errors import ConfigError, InfraError
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import TopicSpec, topology

log = logging.getLogger("kiln.admin")


def delete_topics(settings: KilnSettings, names: list[str], timeout: float = 30.0) -> list[str]:
    """Delete topics by their full names; returns the ones that could not be deleted (with why)."""
    admin = admin_client(settings)  # must outlive the futures
    failed: list[str] = []
    for name, fut in admin.delete_topics(names, operation_timeout=timeout).items():
        try:
            fut.result(timeout)
        except Exception as e:
            failed.append(f"{name}: {e}")
    return failed


def admin_client(settings: KilnSettings) -> AdminClient:
    return AdminClient(settings.kafka())


@dataclass(frozen=True)
class Durability:
    """How the topics kiln creates are replicated on the cluster it finds."""

    brokers: int
    replication: int
    min_insync_replicas: int

    @property
    def can_lose_acknowledged_writes(self) -> bool:
        """With acks=all (kiln's producers), a write is acknowledged once min.insync.replicas replicas have it: on a
        cluster of several brokers, one replica (or one in-sync replica required) loses it with its broker."""
        return self.brokers > 1 and (self.replication < 2 or self.min_insync_replicas < 2)


def cluster_durability(settings: KilnSettings, admin: AdminClient | None = None,
                       timeout: float = 30.0) -> Durability:
    """Replication and min.insync.replicas for new topics: the settings' if set, else the cluster's own defaults
    (a broker's default.replication.factor and min.insync.replicas), else min(3, brokers) and min(2, replication)
    where a broker does not report them."""
    admin = admin or admin_client(settings)
    brokers = sorted(admin.list_topics(timeout=timeout).brokers)
    if not brokers:
        raise InfraError(f"the cluster at {settings.bootstrap_servers} lists no broker")
    resource = ConfigResource(ResourceType.BROKER, str(brokers[0]))
    try:
        entries = admin.describe_configs([resource], request_timeout=timeout)[resource].result(timeout)
        defaults = {name: entry.value for name, entry in entries.items()}
    except Exception as e:  # a broker that does not describe its configs: the fallbacks below
        log.info("broker %s did not describe its configs (%s): replication from the broker count", brokers[0], e)
        defaults = {}

    def reported(name: str) -> int | None:
        value = defaults.get(name)
        return int(value) if value is not None and value.lstrip("-").isdigit() and int(value) > 0 else None

    replication = (settings.topic_replication or reported("default.replication.factor")
                   or min(3, len(brokers)))
    min_insync = (settings.topic_min_insync_replicas or reported("min.insync.replicas")
                  or min(2, replication))
    return Durability(len(brokers), replication, min(min_insync, replication))


def create_topics(settings: KilnSettings, specs: list[TopicSpec] | None = None,
                  timeout: float = 30.0) -> dict[str, str]:
    """Create missing topics (prefixed by settings), by default every registered stage's, replicated as
    ``cluster_durability`` says; returns name -> 'created' | 'exists'. On a cluster of several brokers, refuses
    (ConfigError) to create topics that could lose an acknowledged write unless ``settings.allow_unsafe_topics``."""
    admin = admin_client(settings)
    durability = cluster_durability(settings, admin, timeout)
    if durability.can_lose_acknowledged_writes and not settings.allow_unsafe_topics:
        raise ConfigError(
            f"refusing to create topics with replication {durability.replication} and min.insync.replicas "
            f"{durability.min_insync_replicas} on a cluster of {durability.brokers} brokers: an acknowledged write "
            "would be lost with one broker. Set KILN_TOPIC_REPLICATION (>= 2) and KILN_TOPIC_MIN_INSYNC_REPLICAS "
            "(>= 2), or the cluster's default.replication.factor and min.insync.replicas; KILN_ALLOW_UNSAFE_TOPICS=1 "
            "creates them anyway")
    replicated = ({"min.insync.replicas": str(durability.min_insync_replicas)} if durability.brokers > 1 else {})
    wanted = [
        NewTopic(settings.topic(s.name), num_partitions=s.partitions,
                 replication_factor=durability.replication if durability.brokers > 1 else -1,
                 config={**s.config, **replicated})
        for s in (specs if specs is not None else topology())
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
        _wait_for_leaders(admin, [t.topic for t in todo], timeout)
    return outcome


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout: float) -> None:
    """Created topics are usable once every partition has a leader; until then clients get NOT_LEADER errors."""
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        if all(n in topics and topics[n].partitions and all(p.leader >= 0 for p in topics[n].partitions.values())
               for n in names):
            return
        if time.monotonic() > deadline:
            raise InfraError(f"topics without partition leaders after {timeout:g}s: {names}")
        time.sleep(0.1)


def wait_for_broker(settings: KilnSettings, timeout: float = 60.0) -> int:
    """Block until the cluster answers a metadata request; returns the broker count."""
    try:
        md = admin_client(settings).list_topics(timeout=timeout)
    except Exception as e:
        raise InfraError(f"no Kafka broker at {settings.bootstrap_servers}: {e}") from e
    return len(md.brokers)


CONSUMER_GROUP_HEARTBEAT_API = 68  # KIP-848
SHARE_GROUP_HEARTBEAT_API = 76  # KIP-932


@dataclass(frozen=True)
class BrokerFeatures:
    api_keys: frozenset[int]
    finalized: dict[str, int]  # feature name -> finalized max version level (e.g. share.version)

    @property
    def share_groups(self) -> bool:
        return SHARE_GROUP_HEARTBEAT_API in self.api_keys and self.finalized.get("share.version", 0) >= 1

    @property
    def consumer_protocol(self) -> bool:
        return CONSUMER_GROUP_HEARTBEAT_API in self.api_keys


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value)

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def compact_bytes(self) -> bytes:
        n = self.uvarint() - 1
        out = self.data[self.pos:self.pos + max(n, 0)]
        self.pos += max(n, 0)
        return out

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.pos += self.uvarint()


def _probe_socket(settings: KilnSettings, host: str, port: int, timeout: float) -> socket.socket:
    """A connection speaking the configured security protocol's transport: TLS for SSL/SASL_SSL (verified against
    ``ssl.ca.location``, with the client certificate when configured). ApiVersions needs no SASL step: brokers
    answer it before authentication."""
    sock = socket.create_connection((host, port), timeout=timeout)
    conf = settings.kafka_config
    if str(conf.get("security.protocol", "PLAINTEXT")).upper() not in ("SSL", "SASL_SSL"):
        return sock
    context = ssl.create_default_context(cafile=str(conf["ssl.ca.location"]) if "ssl.ca.location" in conf else None)
    if str(conf.get("ssl.endpoint.identification.algorithm", "https")).lower() == "none":
        context.check_hostname = False
    if "ssl.certificate.location" in conf:
        context.load_cert_chain(str(conf["ssl.certificate.location"]), str(conf.get("ssl.key.location", "")) or None,
                                str(conf.get("ssl.key.password", "")) or None)
    return context.wrap_socket(sock, server_hostname=host)


def broker_features(settings: KilnSettings, timeout: float = 10.0) -> BrokerFeatures:
    """API keys and finalized features of the first bootstrap broker that answers, from a raw ApiVersions v3
    request over the configured transport (plaintext or TLS; see ``_probe_socket``). Every bootstrap server is tried
    in turn, so a cluster with one broker down (or restarting) still answers.

    librdkafka exposes neither to Python; kiln needs them to choose the group protocol (KIP-848) and to refuse
    queue mode where share groups are absent (Redpanda) or not enabled (a Kafka formatted without share.version).
    """
    bootstrap_servers = settings.bootstrap_servers
    client_id, software, version = b"kiln-probe", b"kiln", b"1"
    header = struct.pack(">hhih", 18, 3, 1, len(client_id)) + client_id + b"\x00"
    body = bytes([len(software) + 1]) + software + bytes([len(version) + 1]) + version + b"\x00"
    failures: list[str] = []
    for server in (s.strip() for s in bootstrap_servers.split(",") if s.strip()):
        host, _, port = server.rpartition(":")
        try:
            with _probe_socket(settings, host or "127.0.0.1", int(port), timeout) as sock:
                sock.sendall(struct.pack(">i", len(header + body)) + header + body)
                size = struct.unpack(">i", _recv_exact(sock, 4))[0]
                reader = _Reader(_recv_exact(sock, size))
            break
        except OSError as e:
            failures.append(f"{server}: {e}")
    else:
        raise InfraError(f"ApiVersions probe of {bootstrap_servers} failed: {'; '.join(failures)}")
    reader.take(">i")  # correlation id (ApiVersions responses keep header v0)
    if error := reader.take(">h"):
        raise InfraError(f"ApiVersions error {error} from {bootstrap_servers}")
    keys = set()
    for _ in range(reader.uvarint() - 1):
        keys.add(reader.take(">h"))
        reader.take(">h")
        reader.take(">h")
        reader.skip_tags()
    reader.take(">i")  # throttle time
    finalized: dict[str, int] = {}
    for _ in range(reader.uvarint()):
        tag, length = reader.uvarint(), reader.uvarint()
        end = reader.pos + length
        if tag == 2:  # FinalizedFeatures
            for _ in range(reader.uvarint() - 1):
                name = reader.compact_bytes().decode()
                finalized[name] = reader.take(">h")
                reader.take(">h")
                reader.skip_tags()
        reader.pos = end
    return BrokerFeatures(frozenset(keys), finalized)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return bytes(buf)


def resolve_group_protocol(settings: KilnSettings, wait_s: float = 300.0) -> str:
    """'consumer' (KIP-848) where the broker supports it, else 'classic'; an explicit setting wins. A worker that
    starts while the broker is away (a restart, an outage) waits for it up to ``wait_s`` rather than exiting."""
    if settings.group_protocol != "auto":
        return settings.group_protocol
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return "consumer" if broker_features(settings).consumer_protocol else "classic"
        except InfraError as e:
            if time.monotonic() > deadline:
                raise
            log.warning("%s; waiting for the broker", e)
            time.sleep(1.0)


def group_membership(settings: KilnSettings) -> dict[str, Any]:
    """Consumer-group settings every kiln group member shares: the protocol, and under the classic one a session
    short enough that a killed member's partitions move on in seconds (KIP-848 takes it from the broker)."""
    protocol = resolve_group_protocol(settings)
    if protocol == "classic":
        return {"group.protocol": protocol, "partition.assignment.strategy": "cooperative-sticky",
                "session.timeout.ms": 10000, "heartbeat.interval.ms": 1000, "max.poll.interval.ms": 300000}
    return {"group.protocol": protocol}


def group_coordinator(admin: AdminClient, group: str, timeout: float = 10.0) -> int:
    """The broker coordinating ``group`` (existing or not): the leader of its partition of ``__consumer_offsets``,
    which the broker picks by the group id's Java hash code. For fault injection: the broker whose loss moves it."""
    offsets = admin.list_topics(timeout=timeout).topics["__consumer_offsets"].partitions
    code, units = 0, group.encode("utf-16-be")
    for i in range(0, len(units), 2):
        code = (31 * code + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    signed = code - (1 << 32) if code >= 1 << 31 else code
    return int(offsets[(0 if signed == -(1 << 31) else abs(signed)) % len(offsets)].leader)
