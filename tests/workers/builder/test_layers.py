"""Revisions as layers on real Docker and the registry on S3: 20 revisions (source edits, a deletion, one
dependency change, one documentation-only change), each revision's image runs its own tests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.images import REPORTS_DIR, ImageContract
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.settings import KilnSettings
from kiln.workers.builder import layers
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.revisions import image_for
from kiln.workers.common import reports
from kiln.workers.common.containers import Limits, run_sandboxed
from kiln.workers.common.registry import Registry, read_layer_from_s3
from tests.ingest.gitrepos import Builder, git, write
from tests.workers.builder.projects import python_project

pytestmark = [pytest.mark.docker, pytest.mark.registry, pytest.mark.timeout(900)]


def evolve(b: Builder) -> list[str]:
    """19 more commits on top of the python project; returns every commit, oldest first, and the test counts."""
    commits = [git(b.path, "rev-parse", "HEAD").decode().strip()]
    for i in range(1, 20):
        if i == 6:
            write(b.path, "README.md", "# calc\nNow with documentation.\n")
        elif i == 11:
            text = (b.path / "pyproject.toml").read_text().replace('requires-python = ">=3.9"',
                                                                   'requires-python = ">=3.9"\ndependencies = ["six"]')
            write(b.path, "pyproject.toml", text)
            write(b.path, "tests/test_six.py", "import six\n\n\ndef test_six():\n    assert six.PY3\n")
        elif i == 14:
            b("rm", "-q", "calc/f3.py", "tests/test_f3.py")
        else:
            write(b.path, f"calc/f{i}.py", f"def f{i}(x):\n    return x + {i}\n")
            write(b.path, f"tests/test_f{i}.py", f"from calc.f{i} import f{i}\n\n\ndef test_f{i}():\n"
                                                 f"    assert f{i}(1) == {i + 1}\n")
        commits.append(b.commit(f"revision {i}"))
    return commits


def expected_tests(i: int) -> int:
    count = 2 + sum(1 for k in range(1, i + 1) if k not in (6, 11, 14))
    return count + (1 if i >= 11 else 0) - (1 if i >= 14 else 0)


async def test_twenty_revisions_as_layers(docker_engine: Any, registry: Registry, s3_settings: KilnSettings,
                                          tmp_path: Path) -> None:
    store = SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")
    commits = evolve(python_project(tmp_path / "src"))
    assert (await ingest(IngestRequest(name="demo/layered", location=str(tmp_path / "src")), "r", store,
                         tmp_path / "w")).status == "ingested"
    reg = registry
    bases = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
    limits = Limits(memory_bytes=1 << 30, timeout_s=300)
    images = []
    for commit in commits:
        images.append(await image_for("demo/layered", commit, store, docker_engine, reg, bases, tmp_path / "w",
                                      limits, max_depth=8))
    kinds = [i.kind for i in images]
    assert kinds[0] == "base" and kinds[6] == "same" and images[6].reference == images[5].reference
    assert kinds.count("base") == 3  # depth bounded: re-based after 8 layers
    assert all(i.depth <= 8 for i in images)
    assert layers.lookup(store.blobs, "demo/layered", commits[12]) == images[12]  # resolvable by commit
    test_command = ImageContract.from_labels(
        docker_engine.images.get(images[0].reference.split("@")[0] + ":" + commits[0][:12]).labels).test
    for i, image in enumerate(images):
        await asyncio.to_thread(docker_engine.images.pull, image.reference, auth_config=reg.docker_auth())
        run = await asyncio.to_thread(run_sandboxed, docker_engine, image.reference, test_command, limits=limits,
                                      role="revision-test", collect=REPORTS_DIR)
        report = reports.parse_results("python", run.exit_code, run.files)
        assert report is not None and report.failed == 0, (i, run.output[-2000:])
        assert report.passed == expected_tests(i), (i, report.passed)
    # Layers of a revision read straight from the registry's S3 bucket equal the registry's digests.
    manifest, _ = reg.manifest(layers.registry_name("demo/layered"), images[3].reference.split("@")[1])
    s3 = boto3.client("s3", endpoint_url=s3_settings.s3_endpoint, aws_access_key_id=s3_settings.s3_access_key,
                      aws_secret_access_key=s3_settings.s3_secret_key, region_name=s3_settings.s3_region,
                      config=Config(s3={"addressing_style": "path"}))
    top = manifest["layers"][-1]
    assert len(read_layer_from_s3(s3, "kiln-registry", top["digest"])) == top["size"]
    assert images[3].layer_bytes == top["size"] < 4096  # a source-only revision is a thin layer
    assert json.dumps(manifest["layers"][:-1]) in json.dumps(reg.manifest(
        layers.registry_name("demo/layered"), images[2].reference.split("@")[1])[0]["layers"])
