"""Where repository and agent code runs during a build: on kiln's egress network (no host network; its only reachable
address is the allowlisting proxy ``infra/egress/egress.sh`` starts), non-root where the build system allows, with
CPU, memory, pids and time bounded. One place decides this for ``docker build``, the layered rebuild and the agent.

Configuration (``KILN_BUILD_*``): ``NETWORK`` (kiln-egress), ``PROXY`` (http://172.31.250.1:3128), ``MEMORY_MB``
(4096), ``CPUS`` (2), ``PIDS`` (4096), ``CGROUP`` (kiln-builds: the parent cgroup ``docker build`` steps run
under, whose pids limit the setup script sets, since the classic builder takes no per-build pids limit),
``LOG_BYTES`` (1 MiB: the tail of a build log or an agent command's output kept), ``LAYER_BYTES`` (2 GiB: the most a
layered rebuild may add).
"""

from __future__ import annotations

import json
from typing import Any

from docker.errors import APIError, DockerException, NotFound
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.streams.errors import InfraError

# Capabilities a package manager running as root in the container needs (chown, setuid for apt's sandbox user);
# everything else Docker grants by default (raw sockets, mknod, chroot, ...) is dropped.
ROOT_CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID", "KILL"]
UNPRIVILEGED = "1000:1000"


class BuildSandbox(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_BUILD_")

    network: str = Field("kiln-egress", description="Docker network of build steps; its only way out is the proxy.")
    proxy: str = Field("http://172.31.250.1:3128", description="The allowlisting forward proxy on that network.")
    memory_mb: int = Field(4096, ge=256)
    cpus: float = Field(2.0, gt=0)
    pids: int = Field(4096, ge=64)
    cgroup: str = Field("kiln-builds", description="Parent cgroup of `docker build` steps (pids bounded there).")
    log_bytes: int = Field(1 << 20, ge=4096, description="The tail of a build log or an agent command's output kept "
                           "in memory; the rest is read and dropped.")
    layer_bytes: int = Field(2 << 30, ge=1 << 20, description="The most a layered rebuild may add (read into memory "
                             "to make the revision's layer); a larger rebuild fails.")

    def proxy_env(self) -> dict[str, str]:
        """The variables package managers (pip, npm, cargo, go, curl) read to use the proxy."""
        return {name: self.proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} | {
            "NO_PROXY": "", "no_proxy": ""}

    def verify(self, client: Any) -> None:
        """Fail closed: without kiln's egress network no build step runs (never on another network instead)."""
        try:
            network = client.networks.get(self.network)
        except NotFound:
            raise InfraError(f"build network {self.network!r} does not exist: run `kiln setup docker` "
                             "(infra/egress/egress.sh start)") from None
        except (APIError, DockerException) as e:
            raise InfraError(f"inspecting build network {self.network!r}: {e}") from e
        if network.attrs.get("Labels", {}).get("kiln.role") != "egress":
            raise InfraError(f"network {self.network!r} is not kiln's egress network (label kiln.role=egress)")

    def build_params(self) -> dict[str, Any]:
        """Query parameters of the engine's ``/build`` for one sandboxed build."""
        memory = self.memory_mb << 20
        return {"networkmode": self.network, "buildargs": json.dumps(self.proxy_env()),
                "cgroupparent": self.cgroup, "memory": memory, "memswap": memory,
                "cpushares": max(2, int(1024 * self.cpus))}

    def container_options(self, *, root: bool) -> dict[str, Any]:
        """Keyword arguments of ``containers.create`` for a build container (the agent's, the layered rebuild's)."""
        memory = self.memory_mb << 20
        options: dict[str, Any] = {
            "network_mode": self.network, "mem_limit": memory, "memswap_limit": memory,
            "nano_cpus": int(self.cpus * 1e9), "pids_limit": self.pids, "security_opt": ["no-new-privileges"],
            "cap_drop": ["ALL"], "user": "0:0" if root else UNPRIVILEGED}
        if root:
            options["cap_add"] = ROOT_CAPABILITIES
        return options
