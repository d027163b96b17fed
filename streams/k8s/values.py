"""What a deployment chooses (``infra/k8s/values.yaml`` is the documented default)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageValues(_Strict):
    slots: int = Field(4, ge=1, description="Slots per pod; the pod requests this many CPUs.")
    memory_per_slot_mib: int = Field(1024, ge=64)
    min_workers: int = Field(1, ge=0)
    max_workers: int = Field(100, ge=1)
    container_engine: bool = Field(False, description="Builds or runs containers (build, exec): gets a rootless "
                                                      "engine sidecar and the sandbox node pool.")


class SpareCpu(_Strict):
    """As in Harmonic's REPL service (its fourth version): GPU machines lend a fraction of their CPUs (a
    DaemonSet on nodes labelled for it)."""

    stages: list[str] = Field(default_factory=lambda: ["lean"])
    cpu_fraction: float = Field(0.25, gt=0, le=1)
    node_label: dict[str, str] = Field(default_factory=lambda: {"kiln.dev/spare-cpu": "true"})


class Values(_Strict):
    namespace: str = "kiln"
    image: str = "kiln/kiln:latest"
    engine_image: str = Field("docker:28-dind-rootless", description="The per-pod container engine.")
    bootstrap_servers: str = "kafka.kiln.svc:9092"
    blob_store: str = "s3://kiln/blobs"
    s3_endpoint: str | None = None
    s3_secret: str = Field("kiln-s3", description="Secret with KILN_S3_ACCESS_KEY / KILN_S3_SECRET_KEY.")
    grace_s: float = 30.0
    metrics_port: int = 9400
    preemptible_label: dict[str, str] = Field(default_factory=lambda: {"cloud.google.com/gke-preemptible": "true"})
    sandbox_label: dict[str, str] = Field(default_factory=lambda: {"kiln.dev/sandbox": "true"},
                                          description="Node pool (tainted) for pods with a container engine.")
    control_plane_cidrs: list[str] = Field(default_factory=lambda: ["10.0.0.0/8"],
                                           description="Where Kafka, S3, the registry and the egress proxy live: "
                                                       "the only destinations engine pods may reach.")
    control_plane_ports: list[int] = Field(default_factory=lambda: [9092, 9000, 5000, 3128])
    goal_minutes: float = 5.0
    cpu_target_percent: int = Field(90, ge=1, le=100)
    stages: dict[str, StageValues] = Field(default_factory=lambda: {
        "build": StageValues(slots=2, memory_per_slot_mib=4096, container_engine=True, max_workers=20),
        "exec": StageValues(slots=4, memory_per_slot_mib=2048, container_engine=True),
    }, description="Per-stage choices; a registered stage not named here gets the StageValues defaults.")
    spare_cpu: SpareCpu = Field(default_factory=SpareCpu)
