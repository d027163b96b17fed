"""kiln's exception tree: every error kiln raises on purpose derives from ``KilnError``.

KilnError
├── ConfigError            settings or topology are wrong; fix the deployment, retrying will not help
│   └── MissingExtra       the feature's dependencies are not installed: the message names the extra
├── InfraError             a real component (broker, S3, Docker, registry) is missing or misbehaving
│   ├── BrokerUnavailable  the broker did not answer (metadata timeout, transport failure, delivery timed out):
│   │                      a worker retries with backoff
│   ├── BrokerRefused      the broker answered but refused kiln's credentials (SASL, TLS)
│   └── DockerUnavailable  the Docker engine did not answer
├── DeliveryRefused        a record can never be delivered (an address librdkafka rejects, too large, a topic or
│   │                      partition that does not exist): the job is dead-lettered with the reason
│   └── NoDestination      the topic or partition is not there (for good, unless it is being re-created)
├── BlobError              the blob store failed
│   ├── BlobNotFound       no blob with that digest
│   ├── BlobCorrupt        stored bytes do not hash to their digest
│   └── BlobUnavailable    the store did not answer or refused (outage, missing bucket); also a TransientJobError
├── JobError               raised while running a job; the runtime decides retry vs. DLQ from the subclass
│   ├── TransientJobError  worth retrying with backoff (timeouts, a lost connection)
│   └── PermanentJobError  retrying cannot help: straight to the DLQ
│       ├── MalformedRequest  the message does not parse or validate
│       └── RoutineJobError   an expected way for a request to fail (a lost session, a missing file, a tactic past
│                             its time): answered as a typed error result, never dead-lettered
├── OffsetMapError         commit metadata that does not decode (written by something else, or corrupt)
└── ClientError            the trainer client was misused or a request failed
    ├── RequestExpired     the deadline passed before a result arrived
    ├── RequestFailed      the job ended in the DLQ; carries its reason
    ├── RequestRefused     the request could not be sent (the producer refused it); nothing was submitted
    └── ResultLost         no result arrived within the client's bound (``result_timeout_s``)
"""

from __future__ import annotations


class KilnError(Exception):
    """Root of every error kiln raises deliberately."""


class ConfigError(KilnError):
    """Settings or topology are invalid."""


class MissingExtra(ConfigError):
    """What was asked for needs a dependency the core install (a trainer's) leaves out; the message names the extra
    that brings it (``kiln.streams.extras``)."""


class InfraError(KilnError):
    """A real component is unreachable or misbehaving."""


class BrokerUnavailable(InfraError):
    """The broker did not answer in time; retrying later may succeed."""


class DockerUnavailable(InfraError):
    """The Docker engine did not answer (not running, or ``DOCKER_HOST`` points nowhere)."""


class BrokerRefused(InfraError):
    """The broker answered but refused kiln's credentials (SASL, TLS): fix KILN_KAFKA_CONFIG; retrying will not help."""


class DeliveryRefused(KilnError):
    """A record was refused for good: retrying the same record cannot succeed."""


class NoDestination(DeliveryRefused):
    """The topic (or partition) is not there: for good, unless it existed a moment ago (being re-created)."""

    def __init__(self, message: str, topic: str) -> None:
        super().__init__(message)
        self.topic = topic


class BlobError(KilnError):
    """The blob store failed."""


class BlobNotFound(BlobError):
    """No blob is stored under the digest."""


class BlobCorrupt(BlobError):
    """The stored bytes do not hash to the digest they are stored under."""


class JobError(KilnError):
    """A job failed; the subclass tells the runtime whether to retry."""


class TransientJobError(JobError):
    """Retrying with backoff may succeed."""


class PermanentJobError(JobError):
    """Retrying cannot succeed; the message goes to the dead-letter topic."""


class MalformedRequest(PermanentJobError):
    """The message does not decode or validate against its schema."""


class RoutineJobError(PermanentJobError):
    """The request was understood and cannot succeed for an ordinary reason: the client gets the typed error, the
    dead-letter topic (for malformed input, crashes after retries and bugs) stays clean."""


class ClientError(KilnError):
    """The trainer client was misused or a request failed."""


class RequestExpired(ClientError):
    """The request's deadline passed before its result arrived."""


class RequestFailed(ClientError):
    """The job failed (dead-lettered, or answered with a routine error); ``reason`` says why, ``error_type`` names
    the error the stage raised ("" when unknown)."""

    def __init__(self, request_id: str, reason: str, error_type: str = "") -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason
        self.error_type = error_type


class RequestRefused(ClientError):
    """The producer refused the request (e.g. a key or value too large, an invalid topic): it was not sent."""


class ResultLost(ClientError):
    """No result arrived within the client's bound: it cannot arrive any more (e.g. its results topic was deleted
    with it) or is too late to wait for."""

    def __init__(self, request_id: str, after_s: float) -> None:
        super().__init__(f"no result for request {request_id} within {after_s:g} s")
        self.request_id = request_id
        self.after_s = after_s


class BlobUnavailable(BlobError, TransientJobError):
    """The blob store did not answer or refused the operation; retrying later may succeed."""


class OffsetMapError(KilnError):
    """Commit metadata that does not decode (written by something else, or corrupt)."""
