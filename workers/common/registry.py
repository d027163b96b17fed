"""A small client of the Docker Registry HTTP API v2 (CNCF distribution): what kiln needs to assemble images
itself — read a manifest and config, upload a blob, put a manifest — plus reading layer blobs straight from the
registry's S3 bucket (poolside's optimisation in "Designing a world-class code execution environment": workers
fetch layers from S3, not through the registry)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from kiln.streams.errors import InfraError

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Registry:
    """``host:port`` of a registry reachable over plain HTTP on loopback (what Docker treats as insecure-allowed),
    with the credentials it requires (``infra/registry/registry.sh env``)."""

    address: str
    user: str = ""
    password: str = field(default="", repr=False)
    timeout_s: float = 300.0

    @property
    def _auth(self) -> tuple[str, str] | None:
        return (self.user, self.password) if self.user else None

    def docker_auth(self) -> dict[str, str] | None:
        """The ``auth_config`` of the Docker SDK's push and pull."""
        return {"username": self.user, "password": self.password} if self.user else None

    def _url(self, path: str) -> str:
        return f"http://{self.address}/v2/{path}"

    def _call(self, method: str, url: str, what: str, **kwargs: Any) -> httpx.Response:
        response = httpx.request(method, url, timeout=self.timeout_s, auth=self._auth, **kwargs)
        if response.status_code >= 400:
            raise InfraError(f"registry {what}: HTTP {response.status_code} {response.text[:300]}")
        return response

    def manifest(self, name: str, reference: str) -> tuple[dict[str, Any], str]:
        """The schema-2 manifest and its digest."""
        r = self._call("GET", self._url(f"{name}/manifests/{reference}"), f"manifest {name}:{reference}",
                       headers={"Accept": MANIFEST_V2})
        return r.json(), r.headers.get("Docker-Content-Digest") or sha256_digest(r.content)

    def blob(self, name: str, digest: str) -> bytes:
        data = self._call("GET", self._url(f"{name}/blobs/{digest}"), f"blob {digest}", follow_redirects=True).content
        if sha256_digest(data) != digest:
            raise InfraError(f"registry blob {digest} does not match its digest")
        return data

    def has_blob(self, name: str, digest: str) -> bool:
        response = httpx.head(self._url(f"{name}/blobs/{digest}"), timeout=self.timeout_s, auth=self._auth)
        if response.status_code == 401:
            raise InfraError(f"registry {self.address}: credentials refused")
        return response.status_code == 200

    def put_blob(self, name: str, data: bytes) -> str:
        digest = sha256_digest(data)
        if self.has_blob(name, digest):
            return digest
        location = self._call("POST", self._url(f"{name}/blobs/uploads/"), "upload start").headers["Location"]
        if location.startswith("/"):
            location = f"http://{self.address}{location}"
        joiner = "&" if "?" in location else "?"
        self._call("PUT", f"{location}{joiner}digest={digest}", f"upload {digest}", content=data,
                   headers={"Content-Type": "application/octet-stream"})
        return digest

    def put_manifest(self, name: str, reference: str, manifest: dict[str, Any]) -> str:
        body = json.dumps(manifest, indent=3).encode()
        r = self._call("PUT", self._url(f"{name}/manifests/{reference}"), f"put manifest {name}:{reference}",
                       content=body, headers={"Content-Type": MANIFEST_V2})
        return r.headers.get("Docker-Content-Digest") or sha256_digest(body)


def s3_layer_key(digest: str, root: str = "") -> str:
    """Where CNCF distribution's S3 driver keeps a blob (``rootdirectory`` = ``root``)."""
    hexd = digest.removeprefix("sha256:")
    return f"{root.strip('/') + '/' if root.strip('/') else ''}docker/registry/v2/blobs/sha256/{hexd[:2]}/{hexd}/data"


def read_layer_from_s3(s3: Any, bucket: str, digest: str) -> bytes:
    """A layer blob read straight from the registry's bucket, verified against its digest."""
    data: bytes = s3.get_object(Bucket=bucket, Key=s3_layer_key(digest))["Body"].read()
    if sha256_digest(data) != digest:
        raise InfraError(f"S3 object for {digest} does not match its digest")
    return data
