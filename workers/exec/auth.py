"""Exec session capabilities that never travel on a shared topic.

The client keeps an X25519 key pair and sends its public half with ``open``. The worker makes a random 32-byte
session key and answers with it *sealed* to that public key (ephemeral X25519 + HKDF-SHA256 + ChaCha20-Poly1305),
so whoever else reads the results partition learns nothing usable. Every later request carries
``HMAC-SHA256(session key, request id ‖ op ‖ sha256 of the request without its proofs)``: a forged or altered
request fails, and a replayed one (same request id) gets its first result again. The worker keeps the session key
in the trusted blob store (``exec/keys/<session>``), never on a topic, so a snapshot's maker can be verified later.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kiln.schemas.exec import ExecRequest
from kiln.workers.exec.errors import SealError

_INFO = b"kiln exec session key v1"
_PROOFS = {"auth", "snapshot_auth"}


def new_session_key() -> bytes:
    return os.urandom(32)


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _wrapping_key(shared: bytes, ephemeral: bytes, recipient: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=ephemeral + recipient, info=_INFO).derive(shared)


class ClientKeyPair:
    """The client's half: stays in the trainer's process."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public_b64 = base64.b64encode(_raw(self._private.public_key())).decode()

    def unseal(self, sealed_b64: str) -> bytes:
        try:
            blob = base64.b64decode(sealed_b64, validate=True)
            ephemeral, nonce, ciphertext = blob[:32], blob[32:44], blob[44:]
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(ephemeral))
            key = _wrapping_key(shared, ephemeral, base64.b64decode(self.public_b64))
            return ChaCha20Poly1305(key).decrypt(nonce, ciphertext, ephemeral)
        except Exception as e:  # any malformed or foreign blob
            raise SealError(f"the sealed session key does not open with this client's key: {e}") from None


def seal(session_key: bytes, client_public_b64: str) -> str:
    """``session_key`` readable only by the holder of the private half of ``client_public_b64``."""
    recipient = base64.b64decode(client_public_b64, validate=True)
    ephemeral_private = X25519PrivateKey.generate()
    ephemeral = _raw(ephemeral_private.public_key())
    shared = ephemeral_private.exchange(X25519PublicKey.from_public_bytes(recipient))
    nonce = os.urandom(12)
    ciphertext = ChaCha20Poly1305(_wrapping_key(shared, ephemeral, recipient)).encrypt(nonce, session_key, ephemeral)
    return base64.b64encode(ephemeral + nonce + ciphertext).decode()


def request_digest(request: ExecRequest) -> str:
    """What the proof covers: the whole request but the proofs themselves (canonical JSON of the model)."""
    return hashlib.sha256(request.model_dump_json(exclude=_PROOFS).encode()).hexdigest()


def prove(session_key: bytes, request_id: str, request: ExecRequest) -> str:
    message = f"{request_id}\n{request.op}\n{request_digest(request)}".encode()
    return hmac.new(session_key, message, hashlib.sha256).hexdigest()


def verify(session_key: bytes, request_id: str, request: ExecRequest, proof: str | None) -> bool:
    return proof is not None and hmac.compare_digest(prove(session_key, request_id, request), proof)
