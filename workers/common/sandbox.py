"""The sandbox policy: what every container kiln starts for untrusted code gets, stated once, and the only place that
asks the engine for one (``containers.create``/``containers.run``; tests/workers/common/test_sandbox_policy.py
parses the source packages and finds no other caller, and checks the containers the sandboxing code creates
against ``violations``).

Every such container has
- network: none; a build step (the layered rebuild, the repair agent) kiln's egress network instead, whose only way
  out is the allowlisting proxy (checked here before each create: fail closed, never another network);
- capabilities: all dropped; a profile that runs as root adds back only the few it names;
- privileges: ``no-new-privileges``, never privileged;
- user: ``1000:1000``; root (0:0, with only the profile's capabilities) where the profile needs it: the exec session's
  keeper (uid 1000 must not signal it), the runner's supervisor (it drops to uid 1000 per call), the repair agent
  (it installs system packages);
- limits from one ``Limits`` (bytes, CPUs, a count): memory with no swap beyond it, CPUs, pids; the engine's log
  and ``/dev/shm`` bounded too; an init (not in build containers: its mount point would enter their diff/commit);
- a read-only root whose only writable places are size-limited tmpfs work areas -- except where a profile states
  why not: a build step's root is its product (``docker diff``, ``commit``), and the builder's test run executes
  a project's tests in its own tree (they write into ``/work``: caches, build outputs, reports).

The profiles below are the only ways these differ. Not a container create, so not here: ``docker build``
(``builder/images.py``) goes through the engine's build API, which makes its step containers itself with
``BuildSandbox.build_params()`` (egress network, memory, CPU shares, the cgroup parent that bounds pids).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from docker.errors import APIError, DockerException, NotFound
from docker.types import LogConfig

from kiln.schemas.exec import SessionLimits
from kiln.streams.errors import InfraError

UNPRIVILEGED = "1000:1000"
ROOT = "0:0"
NO_NEW_PRIVILEGES = "no-new-privileges"
PROFILE_LABEL = "kiln.sandbox"
EGRESS_ROLE = "egress"  # the label (kiln.role) kiln's egress network carries (infra/egress/egress.sh)
SHM_BYTES = 64 << 20  # the engine's default /dev/shm, now stated (a profile's caller may ask for less)


@dataclass(frozen=True)
class Limits:
    """The one limits type of untrusted containers; sizes in bytes. ``timeout_s``, ``output_bytes`` (the tail of
    stdout+stderr kept) and ``collect_bytes`` (the most of a collected directory read back) bound a one-shot run
    (``containers.run_sandboxed``); ``disk_bytes`` is the size of the writable work areas together."""

    memory_bytes: int = 2 << 30
    cpus: float = 2.0
    pids: int = 1024
    timeout_s: float = 600.0
    output_bytes: int = 64 << 10
    collect_bytes: int = 256 << 20
    disk_bytes: int = 512 << 20

    @classmethod
    def of_session(cls, limits: SessionLimits) -> Limits:
        """An exec request's limits (the wire's MiB) as a container's."""
        return cls(memory_bytes=limits.memory_mb << 20, cpus=limits.cpus, pids=limits.pids,
                   disk_bytes=limits.disk_mb << 20)


@dataclass(frozen=True)
class Profile:
    """One kind of untrusted container: only these may differ between kinds, everything else is the same."""

    name: str
    network: Literal["none", "egress"] = "none"
    root: bool = False
    capabilities: tuple[str, ...] = ()  # added back after dropping all; only with root
    read_only: bool = True
    init: bool = True
    why: str = ""  # what needs each departure from the strictest (unprivileged, read-only, no capabilities)

    @property
    def user(self) -> str:
        return ROOT if self.root else UNPRIVILEGED


# The builder's test run (containers.run_sandboxed): a project's tests run in their own tree and write into it (with
# a read-only root, even with a tmpfs /tmp, coverage cannot write /work/.coverage nor cargo /work/target:
# tests/workers/builder/test_builder.py, python and cargo, fail).
TEST_RUN = Profile("test-run", read_only=False, why="a project's tests write into their tree (/work)")
# An exec session (exec/sessions.py): commands run as uid 1000 through docker exec; the idle keeper is
# capability-less root so that they cannot signal it; /work and /tmp are tmpfs volumes.
SESSION = Profile("exec-session", root=True, why="the keeper is root so that uid 1000 cannot signal it")
# A run_once runner (exec/runners.py): its supervisor runs each call as uid 1000 and kills and wipes after it.
RUNNER = Profile("exec-runner", root=True, capabilities=("SETUID", "SETGID", "KILL"),
                 why="the supervisor switches to uid 1000 for a call and kills what the call left")
# An image's files read through the archive API (exec/sessions.py ``image_work``): created, never started.
IMAGE_FILES = Profile("image-files")
# The layered rebuild (builder/layers.py): the rebuild's changes to the root become the revision's layer.
BUILD_STEP = Profile("build-step", network="egress", read_only=False, init=False,
                     why="what the step writes to the root is the layer (docker diff); package managers need egress")
# The repair agent (builder/agent.py): installs system packages as root, then the container is committed.
BUILD_AGENT = Profile("build-agent", network="egress", root=True, read_only=False, init=False,
                      capabilities=("CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID", "KILL"),
                      why="package managers install as root (chown, apt's sandbox user); the root is committed")
PROFILES = {p.name: p for p in (TEST_RUN, SESSION, RUNNER, IMAGE_FILES, BUILD_STEP, BUILD_AGENT)}


def log_config(output_bytes: int) -> LogConfig:
    """The engine's log of a container, bounded on disk: two json-files (the current one and the one before it,
    so the tail survives a rotation) of twice what kiln reads back."""
    return LogConfig(type=LogConfig.types.JSON, config={"max-size": f"{max(64, (2 * output_bytes) >> 10)}k",
                                                         "max-file": "2"})


def verify_egress(client: Any, network: str) -> None:
    """Fail closed: without kiln's egress network no build step runs (never on another network instead)."""
    try:
        found = client.networks.get(network)
    except NotFound:
        raise InfraError(f"build network {network!r} does not exist: run `kiln setup docker` "
                         "(infra/egress/egress.sh start)") from None
    except (APIError, DockerException) as e:
        raise InfraError(f"inspecting build network {network!r}: {e}") from e
    if found.attrs.get("Labels", {}).get("kiln.role") != EGRESS_ROLE:
        raise InfraError(f"network {network!r} is not kiln's egress network (label kiln.role={EGRESS_ROLE})")


def options(profile: Profile, limits: Limits, *, egress: str | None = None, shm_bytes: int = SHM_BYTES,
            labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The keyword arguments of the engine's create that make ``profile``'s container: the whole policy."""
    if profile.capabilities and not profile.root:
        raise ValueError(f"profile {profile.name}: capabilities are added back only to root")
    if profile.network == "egress" and not egress:
        raise ValueError(f"profile {profile.name} runs on the egress network: name it")
    found: dict[str, Any] = {
        "network_mode": egress if profile.network == "egress" else "none",
        "user": profile.user, "cap_drop": ["ALL"], "security_opt": [NO_NEW_PRIVILEGES], "privileged": False,
        "mem_limit": limits.memory_bytes, "memswap_limit": limits.memory_bytes, "nano_cpus": int(limits.cpus * 1e9),
        "pids_limit": limits.pids, "shm_size": min(shm_bytes, SHM_BYTES), "read_only": profile.read_only,
        "init": profile.init, "log_config": log_config(limits.output_bytes),
        "labels": {**(labels or {}), PROFILE_LABEL: profile.name},
    }
    if profile.capabilities:
        found["cap_add"] = list(profile.capabilities)
    return found


def create(client: Any, image: str, command: list[str], *, profile: Profile, limits: Limits, start: bool = False,
           egress: str | None = None, name: str | None = None, labels: Mapping[str, str] | None = None,
           environment: Mapping[str, str] | None = None, working_dir: str | None = None,
           tmpfs: Mapping[str, str] | None = None, volumes: Mapping[str, Any] | None = None,
           mounts: list[Any] | None = None, shm_bytes: int = SHM_BYTES, cgroup_parent: str | None = None) -> Any:
    """A container of ``image`` running ``command`` under ``profile`` (created; started too with ``start``, as
    the engine's ``run`` does). Writable places a read-only profile gets: ``tmpfs`` (path -> tmpfs options with a
    size), ``volumes`` made by ``tmpfs_volume``, ``mounts`` of type tmpfs. ``cgroup_parent``: where the engine
    puts its cgroup (a builder worker's own, ``builder/leftovers.py``). The engine's errors pass through."""
    if profile.read_only and any("size=" not in o for o in (tmpfs or {}).values()):
        raise ValueError("a work area of a read-only sandbox needs a size")
    if egress is not None:
        verify_egress(client, egress)
    kwargs = options(profile, limits, egress=egress, shm_bytes=shm_bytes, labels=labels)
    kwargs.update(detach=True, name=name, environment=dict(environment or {}), working_dir=working_dir)
    if tmpfs:
        kwargs["tmpfs"] = dict(tmpfs)
    if volumes:
        kwargs["volumes"] = dict(volumes)
    if mounts:
        kwargs["mounts"] = mounts
    if cgroup_parent:
        kwargs["cgroup_parent"] = cgroup_parent
    if start:
        return client.containers.run(image, command, **kwargs)
    return client.containers.create(image, command, **kwargs)


def tmpfs_volume(client: Any, name: str, size_bytes: int, role: str) -> str:
    """A work area a session's container mounts as a volume (the archive API reaches it, unlike ``--tmpfs``):
    tmpfs, of at most ``size_bytes``, owned by the unprivileged user."""
    uid, gid = UNPRIVILEGED.split(":")
    client.volumes.create(name, driver="local", labels={"kiln.role": role},
                          driver_opts={"type": "tmpfs", "device": "tmpfs",
                                       "o": f"size={size_bytes},uid={uid},gid={gid},mode=0755"})
    return name


def violations(attrs: Mapping[str, Any], egress: str) -> list[str]:
    """Where an inspected container (``docker inspect``) departs from the policy of the profile it is labelled
    with (none when it follows it; a container without a profile is one kiln should not have made)."""
    config, host = attrs.get("Config") or {}, attrs.get("HostConfig") or {}
    name = str(attrs.get("Name", "?")).lstrip("/")
    profile = PROFILES.get((config.get("Labels") or {}).get(PROFILE_LABEL, ""))
    if profile is None:
        return [f"{name}: not created by the sandbox policy (no {PROFILE_LABEL} label)"]
    found = []

    def expect(what: str, value: Any, wanted: Any) -> None:
        if value != wanted:
            found.append(f"{name} ({profile.name}): {what} is {value!r}, the policy says {wanted!r}")

    expect("NetworkMode", host.get("NetworkMode"), egress if profile.network == "egress" else "none")
    expect("CapDrop", host.get("CapDrop"), ["ALL"])
    expect("CapAdd", sorted(host.get("CapAdd") or []), sorted(profile.capabilities))
    expect("no-new-privileges", NO_NEW_PRIVILEGES in (host.get("SecurityOpt") or []), True)
    expect("Privileged", host.get("Privileged"), False)
    expect("User", config.get("User"), profile.user)
    expect("ReadonlyRootfs", host.get("ReadonlyRootfs"), profile.read_only)
    expect("Init", bool(host.get("Init")), profile.init)
    memory = host.get("Memory") or 0
    expect("Memory set", memory > 0, True)
    expect("MemorySwap", host.get("MemorySwap"), memory)
    expect("NanoCpus set", (host.get("NanoCpus") or 0) > 0, True)
    expect("PidsLimit set", (host.get("PidsLimit") or 0) > 0, True)
    expect("ShmSize bounded", 0 < (host.get("ShmSize") or 0) <= SHM_BYTES, True)
    if profile.read_only:
        writable = [m for m in attrs.get("Mounts") or [] if m.get("RW")]
        expect("writable mounts not tmpfs", [m.get("Destination") for m in writable
                                             if m.get("Type") not in ("tmpfs", "volume")], [])
    return found
