"""How kiln installs: one ``kiln`` namespace in site-packages, runnable from anywhere; and each checkout runs its own
code (its own .venv over the shared, cached dependency environment of infra/bootstrap.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kiln.streams.processes import WorkerProcess, free_port
from kiln.streams.settings import KilnSettings

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = str(Path(sys.base_prefix) / "bin" / "python3")  # the interpreter behind the venvs


def _copy_checkout(dst: Path) -> Path:
    """The checkout's files as git sees them (tracked, and untracked but not ignored), links kept as links."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src, target = ROOT / rel, dst / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, target)
    return dst


def _site_packages(venv: Path) -> Path:
    return Path(subprocess.run([str(venv / "bin/python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def _shared_deps_site() -> str:
    """The dependency environment behind this checkout's .venv (what a user's own dependencies would be)."""
    import pydantic

    return str(Path(pydantic.__file__).parents[1])


def _wheel(tmp_path: Path) -> Path:
    """kiln's wheel, built from a copy of the checkout (a build in place would leave its files here)."""
    source = _copy_checkout(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("kiln-*.whl")
    return wheel


def test_a_wheel_installs_only_kiln_and_runs_a_job_outside_the_repository(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                         tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)

    venv = tmp_path / "clean"
    subprocess.run([BASE_PYTHON, "-m", "venv", str(venv)], check=True)
    site = _site_packages(venv)
    before = set(os.listdir(site))
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    added = set(os.listdir(site)) - before
    assert added == {"kiln", "kiln-0.1.0.dist-info"}, added
    assert {"streams", "schemas", "workers", "ingest", "rl", "integrations"}.isdisjoint(os.listdir(site))
    assert not (site / "kiln" / "streams").is_symlink() and (site / "kiln/schemas/jsonschema").is_dir()
    assert (site / "kiln/integrations/demo/calc-repo/tests/test_calc.py").is_file()  # the demo's repository ships
    assert (site / "kiln/py.typed").is_file()

    # Its dependencies come from the shared environment (as a user's would from their own); then a job, from a
    # directory that is not the repository.
    (site / "_deps.pth").write_text(f"import site; site.addsitedir({_shared_deps_site()!r})\n")
    request_topic, results = topics(partitions=2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "KILN_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
           "KILN_CACHE": str(tmp_path / "cache")}
    worker = subprocess.Popen([str(venv / "bin/kiln"), "worker", "echo", "--topic", request_topic, "--slots", "2"],
                              cwd=elsewhere, env={**env, "KILN_METRICS_PORT": str(free_port())},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    script = textwrap.dedent(f"""
        import asyncio, kiln
        from kiln.streams.client import KilnClient
        from kiln.schemas.builtin import EchoRequest
        async def main():
            async with KilnClient(results_topic={results!r}) as client:
                result = await client.call("echo", EchoRequest(data="from outside"), topic={request_topic!r})
                print(kiln.__file__, result.data)
        asyncio.run(main())
    """)
    try:
        ran = subprocess.run([str(venv / "bin/python"), "-c", script], cwd=elsewhere, env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        worker.terminate()
        worker_output = worker.communicate(timeout=60)[0]
    assert ran.returncode == 0, ran.stderr + worker_output
    where, data = ran.stdout.split(maxsplit=1)
    assert where == str(site / "kiln" / "__init__.py") and data.strip() == "from outside"


def test_the_wheel_is_typed_for_its_users(tmp_path: Path) -> None:
    """PEP 561: the wheel carries ``kiln/py.typed``, so a user's mypy reads kiln's annotations from the installed
    package instead of treating it as untyped."""
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        assert "kiln/py.typed" in archive.namelist()
    venv = tmp_path / "user"
    subprocess.run([BASE_PYTHON, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    (_site_packages(venv) / "_deps.pth").write_text(f"import site; site.addsitedir({_shared_deps_site()!r})\n")
    user = tmp_path / "elsewhere" / "user.py"
    user.parent.mkdir()
    user.write_text("from kiln.streams.settings import KilnSettings\n\nx: int = KilnSettings().bootstrap_servers\n")
    checked = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--python-executable",
                              str(venv / "bin/python"), "--follow-imports", "silent", "user.py"],
                             cwd=user.parent, capture_output=True, text=True)
    # kiln's annotation reached the user's checker: a str is not an int (untyped, kiln would be an error of its own)
    assert 'Incompatible types in assignment (expression has type "str", variable has type "int")' in checked.stdout, \
        checked.stdout + checked.stderr
    assert "missing library stubs or py.typed marker" not in checked.stdout


def test_two_checkouts_side_by_side_each_run_their_own_code(tmp_path: Path) -> None:
    clones = {name: _copy_checkout(tmp_path / name) for name in ("a", "b")}
    for name, clone in clones.items():
        with (clone / "kiln" / "__init__.py").open("a") as f:
            f.write(f"\nCHECKOUT = {name!r}\n")
    for clone in [*clones.values(), clones["a"]]:  # a again after b: bootstrapping b must not re-point a
        done = subprocess.run(["bash", "infra/bootstrap.sh"], cwd=clone, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert not (clones["a"] / ".venv").is_symlink()
    for name, clone in clones.items():
        seen = subprocess.run([str(clone / ".venv/bin/python"), "-c",
                               "import kiln, kiln.streams.cli; print(kiln.CHECKOUT, kiln.streams.cli.__file__)"],
                              cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
        assert seen == [name, str(clone / "kiln" / "streams" / "cli.py")]
        stages = subprocess.run([str(clone / ".venv/bin/kiln"), "stages"], capture_output=True, text=True,
                                env={**os.environ, "COLUMNS": "200"}, check=True).stdout
        assert "exec.requests" in stages
    # Both stand on one cached dependency environment: a second checkout costs no download.
    assert (clones["a"] / ".venv/.kiln-deps").read_text() == (clones["b"] / ".venv/.kiln-deps").read_text()


HEAVY = {"docker", "boto3", "botocore", "faust-streaming", "aiokafka", "fastapi", "uvicorn", "torch", "httpx"}
"""What the core install must not pull: workers', operations' and RL's dependencies (extras)."""


@pytest.mark.timeout(900)
def test_the_core_install_is_a_trainers_client_and_runs_a_round_trip(kafka: KilnSettings, topics,  # type: ignore[no-untyped-def]
                                                                     tmp_path: Path) -> None:
    """``pip install kiln`` (no extras) into a clean venv, its dependencies from PyPI (pip's cache outside the repo):
    none of the heavy ones; a client round trip against an echo worker of the full install; a command of an extra
    it lacks says which extra brings it."""
    wheel = _wheel(tmp_path)
    venv = tmp_path / "core"
    subprocess.run([BASE_PYTHON, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", str(wheel)], check=True,
                   timeout=600)
    listed = subprocess.run([str(venv / "bin/pip"), "list", "--format=freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    installed = {line.split("==")[0].lower() for line in listed.split()}
    assert "confluent-kafka" in installed and "kiln" in installed, installed
    assert installed.isdisjoint(HEAVY), installed & HEAVY

    request_topic, results = topics(partitions=2)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "KILN_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
           "KILN_CACHE": str(tmp_path / "cache")}
    script = textwrap.dedent(f"""
        import asyncio
        from kiln.streams.client import KilnClient
        from kiln.schemas.builtin import EchoRequest
        async def main():
            async with KilnClient(results_topic={results!r}) as client:
                result = await client.call("echo", EchoRequest(data="from a trainer"), topic={request_topic!r})
                print(result.data)
        asyncio.run(main())
    """)
    with WorkerProcess("echo", kafka, request_topic, slots=2) as worker:
        worker.wait_assigned()
        ran = subprocess.run([str(venv / "bin/python"), "-c", script], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        worker.stop()
    assert ran.returncode == 0 and ran.stdout.strip() == "from a trainer", ran.stderr + worker.log.read_text()

    stats = subprocess.run([str(venv / "bin/kiln"), "stats", "serve"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
    assert stats.returncode != 0 and "pip install 'kiln[ops]'" in stats.stderr, stats.stdout + stats.stderr
    assert "Traceback" not in stats.stderr
