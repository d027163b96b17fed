"""Where repository and agent code runs during a build: on kiln's egress network (no host network; its only reachable
address is the allowlisting proxy ``infra/egress/egress.sh`` starts), non-root where the build system allows, with
CPU, memory, pids and time bounded. The settings of ``docker build``, the layered rebuild and the agent; their
containers' policy is the sandbox policy's (``workers/common/sandbox.py``: profiles ``BUILD_STEP``, ``BUILD_AGENT``).

Configuration (``KILN_BUILD_*``): ``NETWORK`` (kiln-egress), ``PROXY`` (http://172.31.250.1:3128), ``MEMORY_MB``
(4096), ``CPUS`` (2), ``PIDS`` (4096), ``CGROUP`` (kiln-builds: the parent cgroup ``docker build`` steps run
under, whose pids limit the setup script sets, since the classic builder takes no per-build pids limit; in a
builder worker, every container of its builds runs in the worker's own cgroup below it: ``leftovers.py``),
``LOG_BYTES`` (1 MiB: the tail of a build log or an agent command's output kept), ``LAYER_BYTES`` (2 GiB: the most a
layered rebuild may add).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.workers.builder.leftovers import WORKER
from kiln.workers.common import sandbox as policy
from kiln.workers.common.sandbox import Limits

UNPRIVILEGED = policy.UNPRIVILEGED


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
        policy.verify_egress(client, self.network)

    def limits(self) -> Limits:
        """A build container's limits (``docker build`` takes them as ``build_params``)."""
        return Limits(memory_bytes=self.memory_mb << 20, cpus=self.cpus, pids=self.pids, output_bytes=self.log_bytes)

    def worker_cgroup(self) -> str | None:
        """The cgroup parent of the containers a builder worker's build creates (tests, rebuilds, the agent's), by
        which its leftovers are found once it is dead; None outside a worker (the engine's default)."""
        return WORKER.cgroup(self.cgroup) if WORKER.lock is not None else None

    def build_params(self) -> dict[str, Any]:
        """Query parameters of the engine's ``/build`` for one sandboxed build."""
        memory = self.limits().memory_bytes
        return {"networkmode": self.network, "buildargs": json.dumps(self.proxy_env()),
                "cgroupparent": WORKER.cgroup(self.cgroup), "memory": memory, "memswap": memory,
                "cpushares": max(2, int(1024 * self.cpus))}
