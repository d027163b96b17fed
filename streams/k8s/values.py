"""What a deployment chooses (``infra/k8s/values.yaml`` is the documented default). Each stage's own needs (slots,
memory, a container engine, spare CPUs) come from its spec (``StageSpec.deployment``); values override them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.streams.stage import Deployment, StageSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageValues(_Strict):
    """One stage's pods. In a values file, a field left out is the stage's own (``StageSpec.deployment``)."""

    slots: int = Field(Deployment.slots, ge=1, description="Slots per pod; the pod requests this many CPUs.")
    memory_per_slot_mib: int = Field(Deployment.memory_per_slot_mib, ge=64)
    min_workers: int = Field(1, ge=0)
    max_workers: int = Field(Deployment.max_workers, ge=1)
    container_engine: bool = Field(Deployment.container_engine, description="Builds or runs containers (build, "
                                   "exec): gets a rootless engine sidecar and the sandbox node pool.")
    cpu: str | None = Field(None, description="CPU of each pod (a Kubernetes quantity, e.g. 100m); unset: one per "
                                              "slot.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the stage's workers (its "
                                                                  "KILN_<STAGE>_* settings).")


class SpareCpu(_Strict):
    """As in Harmonic's REPL service (its fourth version): GPU machines lend a fraction of their CPUs (a
    DaemonSet on nodes labelled for it)."""

    stages: list[str] | None = Field(None, description="Stages with spare-CPU DaemonSets; unset: those whose spec "
                                     "asks for them (Deployment.spare_cpu).")
    cpu_fraction: float = Field(0.25, gt=0, le=1)
    node_label: dict[str, str] = Field(default_factory=lambda: {"kiln.dev/spare-cpu": "true"})


class Values(_Strict):
    namespace: str = "kiln"
    image: str = "kiln/kiln:latest"
    engine_image: str = Field("docker:28-dind-rootless", description="The per-pod container engine.")
    engine_rootful: bool = Field(False, description="The engine runs as root (privileged, its data on an emptyDir). "
                                 "Only for cgroup-v1 nodes, where a rootless engine runs without cgroups and cannot "
                                 "limit a sandbox's memory, pids or CPU; an escape from it is root on the node.")
    engine_args: list[str] = Field(default_factory=list, description="Extra arguments of the engine's dockerd, "
                                   "e.g. --insecure-registry for the registry sessions pull from.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of every kiln container.")
    cpu_limits: bool = Field(True, description="Limit each pod to the CPUs it requests (Guaranteed QoS). Off: "
                             "requests only, for a node shared with other work.")
    service_cpu: str = Field("500m", description="CPU of the autoscaler, stats and Saucer pods.")
    service_memory_mib: int = Field(1024, ge=64)
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
    autoscaler_tick_s: float = Field(60.0, gt=0, description="Seconds between the autoscaler's decisions.")
    polling_interval_s: int = Field(30, ge=1, description="How often KEDA reads each ScaledObject's triggers.")
    scale_down_window_s: int | None = Field(None, ge=0, description="The HPA's scale-down stabilization window; "
                                            "unset: Kubernetes' default (300 s).")
    cpu_target_percent: int = Field(90, ge=1, le=100)
    stages: dict[str, StageValues] = Field(default_factory=dict, description="Per-stage choices over each stage's "
                                           "own (StageSpec.deployment); a field not named keeps the stage's.")
    spare_cpu: SpareCpu = Field(default_factory=SpareCpu)


def stage_values(values: Values, spec: StageSpec) -> StageValues:
    """A stage's pods: its spec's deployment, then the fields the values name for it."""
    own = spec.deployment
    chosen = values.stages.get(spec.kind)
    fields = {"slots": own.slots, "memory_per_slot_mib": own.memory_per_slot_mib, "max_workers": own.max_workers,
              "container_engine": own.container_engine}
    return StageValues.model_validate({**fields, **(chosen.model_dump(exclude_unset=True) if chosen else {})})


def spare_cpu_stages(values: Values, specs: list[StageSpec]) -> list[str]:
    """The stages with spare-CPU DaemonSets: the values' list, else those whose spec asks for spare CPUs."""
    if values.spare_cpu.stages is not None:
        return list(values.spare_cpu.stages)
    return sorted(s.kind for s in specs if s.deployment.spare_cpu)
