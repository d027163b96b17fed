"""kiln's exception tree: every error kiln raises on purpose derives from ``KilnError``.

KilnError
├── ConfigError            settings or topology are wrong; fix the deployment, retrying will not help
├── InfraError             a real component (broker, S3, Docker, registry) is missing or misbehaving
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
└── ClientError            the trainer client was misused or a request failed
    ├── RequestExpired     the deadline passed before a result arrived
    └── RequestFailed      the job ended in the DLQ; carries its reason
"""

from __future__ import annotations


class KilnError(Exception):
    """Root of every error kiln raises deliberately."""


class ConfigError(KilnError):
    """Settings or topology are invalid."""


class InfraError(KilnError):
    """A real component is unreachable or misbehaving."""


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
    """The job was dead-lettered; ``reason`` says why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class BlobUnavailable(BlobError, TransientJobError):
    """The blob store did not answer or refused the operation; retrying later may succeed."""
