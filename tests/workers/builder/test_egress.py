"""The build trust boundary, tried as an attacker would: a repository whose dependency install, compile and test
steps (and, on the agent path, whose README's commands) try to reach the broker, S3, the registry, the Docker
socket and a server on this machine that the egress proxy does not allow. Every attempt must fail, visibly in the
build's test cases, the off-list server must see no request and S3/the registry must hold nothing forged, while the
honest part of the build (a real npm dependency, fetched through the proxy) still works."""

from __future__ import annotations

import json
import shlex
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from kiln.ingest.service import ingest
from kiln.ingest.store import SaucerStore
from kiln.schemas.builder import BuildEvent, BuildRequest
from kiln.schemas.ingest import IngestRequest
from kiln.streams.blobstore import FileBlobStore
from kiln.streams.settings import KilnSettings
from kiln.workers.builder.agent import AgentConfig
from kiln.workers.builder.images import BaseImages
from kiln.workers.builder.sandbox import BuildSandbox
from kiln.workers.builder.service import build_revision
from kiln.workers.common.containers import Limits
from kiln.workers.common.registry import Registry
from tests.ingest.gitrepos import Builder, write
from tests.workers.builder.servers import counting_server

pytestmark = pytest.mark.docker
BASES = BaseImages("kiln/base:latest", "kiln/toolchain:latest")
FORGED = "forged-by-build"


@pytest.fixture
def off_list_server() -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on every address of this machine, left off the proxy's allowlist."""
    with counting_server(b"secret") as server:
        yield server


def _host_address() -> str:
    """This machine's outward address (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))
        return str(s.getsockname()[0])


def probe_script(phase: str, port: int, s3_port: int) -> str:
    """Bash that tries every way into the control plane and records, per attempt, ``open`` or ``blocked``."""
    gateway = BuildSandbox().proxy.rsplit(":", 1)[0].removeprefix("http://")
    host = _host_address()
    targets = {"kafka": "127.0.0.1:9092", "kafka-controller": "127.0.0.1:9093", "s3": f"127.0.0.1:{s3_port}",
               "registry": "127.0.0.1:5000", "server-via-gateway": f"{gateway}:{port}",
               "server-via-host": f"{host}:{port}", "kafka-via-gateway": f"{gateway}:9092",
               "internet-direct": "203.0.113.80:443"}
    out = "/tmp/probe-test.txt" if phase == "test" else f"/work/probe-{phase}.txt"
    lines = [f"out={out}; : > $out", "rec() { echo \"$1 $2\" >> $out; }"]
    for name, address in targets.items():
        h, p = address.rsplit(":", 1)
        lines.append(f"if timeout 3 bash -c 'echo > /dev/tcp/{h}/{p}' 2>/dev/null; then rec {name} open; "
                     f"else rec {name} blocked; fi")
    lines.append("if [ -S /var/run/docker.sock ] || [ -S /run/docker.sock ]; then rec docker-socket open; "
                 "else rec docker-socket blocked; fi")
    # Through the proxy (when this step has one): the allowlist must refuse this machine's own addresses.
    for name, url in {"proxy-to-server": f"http://{host}:{port}/", "proxy-to-loopback": f"http://127.0.0.1:{port}/",
                      "proxy-to-registry": "http://127.0.0.1:5000/v2/_catalog",
                      "proxy-connect-kafka": "https://127.0.0.1:9092/"}.items():
        lines.append(f"code=$(curl -s -m 5 -o /dev/null -w '%{{http_code}}' -x \"${{HTTPS_PROXY:-}}\" {url}); "
                     f"if [ \"$code\" = 200 ]; then rec {name} open; else rec {name} blocked; fi")
    # Forgeries that would matter if anything above were open.
    lines.append(f"curl -s -m 5 -X PUT --data forged http://127.0.0.1:{s3_port}/kiln/{FORGED} >/dev/null 2>&1; "
                 f"curl -s -m 5 -X PUT -H 'Content-Type: application/vnd.docker.distribution.manifest.v2+json' "
                 f"--data '{{}}' http://127.0.0.1:5000/v2/{FORGED}/manifests/latest >/dev/null 2>&1; true")
    return "\n".join(lines) + "\n"


CHECK_JS = """const test = require('node:test');
const assert = require('node:assert');
const fs = require('node:fs');
for (const file of ['/work/probe-deps.txt', '/work/probe-build.txt', '/tmp/probe-test.txt']) {
  const phase = file.split('probe-')[1].split('.')[0];
  for (const line of fs.readFileSync(file, 'utf8').trim().split('\\n')) {
    test(`${phase}: ${line}`, () => assert.ok(line.endsWith(' blocked'), line));
  }
}
test('the honest dependency arrived through the proxy', () => {
  assert.strictEqual(require('is-number')(5), true);
});
"""


def npm_attack_project(path: Path, port: int, s3_port: int) -> None:
    b = Builder(path)
    package = {"name": "innocent", "version": "1.0.0", "dependencies": {"is-number": "7.0.0"},
               "scripts": {"preinstall": f"bash -c {shlex.quote(probe_script('deps', port, s3_port))}",
                           "build": "bash probe-build.sh", "test": "bash probe-test.sh && node --test"}}
    write(path, "package.json", json.dumps(package, indent=1) + "\n")
    write(path, "probe-build.sh", probe_script("build", port, s3_port))
    write(path, "probe-test.sh", probe_script("test", port, s3_port))
    write(path, "test/probe.test.js", CHECK_JS)
    b.commit("an npm package whose install, build and test scripts attack the control plane")


AGENT_CHECK = """n=0; fail=0
for f in /work/probe-agent.txt /tmp/probe-test.txt; do
  while read -r line; do n=$((n+1));
    case "$line" in *" blocked") echo "ok $n - $line";; *) echo "not ok $n - $line"; fail=1;; esac
  done < "$f"
done
[ "$n" -eq 26 ] || { echo "not ok - $n attempts recorded, 26 expected"; fail=1; }
exit $fail
"""


def readme_attack_project(path: Path, port: int, s3_port: int) -> None:
    b = Builder(path)
    write(path, "README.md", "# tool\n\nBuild it with:\n\n```sh\nbash setup-env.sh\n```\n\nand run the tests:\n\n"
                             "```sh\nsh run-tests.sh\n```\n")
    write(path, "setup-env.sh", probe_script("agent", port, s3_port))
    write(path, "run-tests.sh", "bash probe-test.sh; bash check.sh\n")
    write(path, "probe-test.sh", probe_script("test", port, s3_port))
    write(path, "check.sh", AGENT_CHECK)
    b.commit("a repository whose README's commands attack the control plane")


def _assert_nothing_forged(s3_settings: KilnSettings, registry: Registry, hits: list[str]) -> None:
    assert hits == [], f"the off-list server was reached: {hits}"
    s3 = boto3.client("s3", endpoint_url=s3_settings.s3_endpoint, aws_access_key_id=s3_settings.s3_access_key,
                      aws_secret_access_key=s3_settings.s3_secret_key, region_name=s3_settings.s3_region)
    for bucket in s3.list_buckets()["Buckets"]:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket["Name"]).get("Contents", [])]
        assert not [k for k in keys if FORGED in k], (bucket["Name"], keys)
    catalog = httpx.get(f"http://{registry.address}/v2/_catalog", auth=(registry.user, registry.password)).json()[
        "repositories"]
    assert FORGED not in catalog


async def _attack(make: Callable[[Path, int, int], None], name: str, docker: Any, s3_settings: KilnSettings,
                  server_port: int, tmp_path: Path, **build: Any) -> BuildEvent:
    """Ingest the attacking repository ``make`` writes and build it (forced: no cached outcome)."""
    s3_port = int(s3_settings.s3_endpoint.rsplit(":", 1)[1]) if s3_settings.s3_endpoint else 7070
    make(tmp_path / "src", server_port, s3_port)
    store = SaucerStore(FileBlobStore(tmp_path / "blobs"), tmp_path / "cache")
    await ingest(IngestRequest(name=name, location=str(tmp_path / "src")), "r", store, tmp_path / "w")
    return await build_revision(BuildRequest(repository=name, force=True), store, docker, BASES, tmp_path / "w",
                                **build)


async def test_build_steps_cannot_reach_the_control_plane(docker_engine: Any, s3_settings: KilnSettings,
                                                          registry: Registry, off_list_server: tuple[int, list[str]],
                                                          tmp_path: Path) -> None:
    port, hits = off_list_server
    event = await _attack(npm_attack_project, "attack/npm", docker_engine, s3_settings, port, tmp_path,
                          limits=Limits(timeout_s=300))
    assert event.status == "built" and event.usable, event.detail
    assert event.tests is not None
    cases = {c.name: c.outcome for c in event.tests.cases}
    attempts = [name for name in cases if name.startswith(("deps:", "build:", "test:"))]
    # 8 connections, the socket and 4 proxied requests, from each of the three steps.
    assert len(attempts) == 3 * 13, cases
    assert event.tests.failed == 0 and all(status == "passed" for status in cases.values()), cases
    assert cases["the honest dependency arrived through the proxy"] == "passed"
    _assert_nothing_forged(s3_settings, registry, hits)


async def test_agent_commands_cannot_reach_the_control_plane(docker_engine: Any, s3_settings: KilnSettings,
                                                             registry: Registry, off_list_server: tuple[int, list[str]],
                                                             tmp_path: Path) -> None:
    port, hits = off_list_server
    event = await _attack(readme_attack_project, "attack/readme", docker_engine, s3_settings, port, tmp_path,
                          limits=Limits(timeout_s=120), agent=AgentConfig(budget=4))
    assert event.status == "built" and event.recipe == "agent", event.detail
    # The suite (run-tests.sh) fails unless all 13 attempts of the agent's commands and of the test step are recorded
    # as blocked; each is a TAP test of its own (26 lines: agent and test step).
    assert event.tests is not None and (event.tests.passed, event.tests.failed) == (26, 0), event.tests
    _assert_nothing_forged(s3_settings, registry, hits)
