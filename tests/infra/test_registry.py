"""The registry stores into the real S3 server: push, pull by digest, and the layer blob read back from S3."""

from __future__ import annotations

import hashlib
import io
import tarfile
from typing import Any

import boto3
import httpx
from botocore.config import Config

from kiln.streams.settings import KilnSettings
from kiln.workers.common.registry import Registry

MANIFEST_TYPES = ",".join([
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
])


def _tiny_image_context(payload: bytes) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("Dockerfile", b"FROM scratch\nCOPY payload /payload\n"), ("payload", payload)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def test_push_pull_with_blobs_in_s3(docker_engine: Any, registry: Registry, s3_settings: KilnSettings,
                                     unique: str) -> None:
    repo = f"{registry.address}/kiln-test/img-{unique}"
    payload = f"kiln registry test {unique}\n".encode() * 1000
    image, _ = docker_engine.images.build(fileobj=_tiny_image_context(payload), custom_context=True,
                                          tag=f"{repo}:v1", network_mode="host", rm=True)
    # Without credentials the registry refuses pushes (and everything else).
    refused = list(docker_engine.images.push(repo, tag="v1", stream=True, decode=True))
    assert any("error" in line for line in refused), refused
    assert httpx.get(f"http://{registry.address}/v2/_catalog").status_code == 401
    for line in docker_engine.images.push(repo, tag="v1", stream=True, decode=True,
                                          auth_config=registry.docker_auth()):
        assert "error" not in line, line

    manifest_resp = httpx.get(f"http://{registry.address}/v2/kiln-test/img-{unique}/manifests/v1",
                              headers={"Accept": MANIFEST_TYPES}, auth=(registry.user, registry.password))
    manifest_resp.raise_for_status()
    digest = manifest_resp.headers["Docker-Content-Digest"]
    layer_digest = manifest_resp.json()["layers"][0]["digest"]

    # The layer is an object in the registry's bucket; read straight from S3 it hashes to its digest.
    s3 = boto3.client("s3", endpoint_url=s3_settings.s3_endpoint, aws_access_key_id=s3_settings.s3_access_key,
                      aws_secret_access_key=s3_settings.s3_secret_key, region_name=s3_settings.s3_region,
                      config=Config(s3={"addressing_style": "path"}))
    hexd = layer_digest.removeprefix("sha256:")
    body = s3.get_object(Bucket="kiln-registry", Key=f"docker/registry/v2/blobs/sha256/{hexd[:2]}/{hexd}/data")
    assert "sha256:" + hashlib.sha256(body["Body"].read()).hexdigest() == layer_digest

    docker_engine.images.remove(image.id, force=True)
    pulled = docker_engine.images.pull(f"{repo}@{digest}", auth_config=registry.docker_auth())
    assert pulled.id == image.id
    docker_engine.images.remove(pulled.id, force=True)
