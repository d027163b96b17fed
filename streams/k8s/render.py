"""The manifests, as plain dicts (``render(values, specs)`` -> a list of Kubernetes objects).

Choices a reviewer should know:
- Workers prefer preemptible nodes and tolerate their taint; terminationGracePeriodSeconds exceeds the runtime's
  grace so SIGTERM's drain-and-commit always finishes before SIGKILL.
- Pods of a stage that asks for one (``Deployment.container_engine`` in its spec: build, exec) get their own
  rootless Docker engine as a sidecar, never the node's socket (mounting it is root on the node). The sidecar must
  run privileged for its user namespaces, but its daemon runs as uid 1000: an escape from a sandbox lands as an
  unprivileged user inside one pod, on a tainted node pool of its own. The worker and the engine share the pod's
  process namespace (the exec stage empties session containers by pid) and an emptyDir for the socket; there is no
  hostPath anywhere. The engine is a native sidecar (an init container with ``restartPolicy: Always``, Kubernetes
  1.29+): the worker starts only once its engine answers (the sidecar's startup probe) -- a worker started first
  exits, Docker unreachable, and the kubelet restarts it after a back-off that doubles each time (10 s, 20 s, ...),
  holding back the Ready of a pod KEDA added -- and on a pod's deletion the engine is stopped only after the worker
  has drained its jobs.
- NetworkPolicies: pods with an engine may reach only the control-plane services (Kafka, S3, registry, egress
  proxy) and DNS; sandboxes inside the engine have no network of their own (``--network none``) besides that.
- Scaling: KEDA's metrics-api trigger reads the autoscaler's minimum (Harmonic's REPL service rule) and its cpu
  trigger scales above it; the larger wins.
"""

from __future__ import annotations

from typing import Any

from kiln.streams.k8s.values import StageValues, Values, spare_cpu_stages, stage_values
from kiln.streams.stage import StageSpec

Manifest = dict[str, Any]
STATS_PORT, AUTOSCALER_PORT, SAUCER_PORT = 8600, 8800, 8700
ENGINE_SOCKET_DIR = "/run/kiln-engine"
EXEC_DIRS = "/run/kiln"  # the exec stage's liveness locks (run/kiln/exec) and its label seal's secret


def _meta(name: str, values: Values, **labels: str) -> dict[str, Any]:
    return {"name": name, "namespace": values.namespace,
            "labels": {"app.kubernetes.io/part-of": "kiln", "app.kubernetes.io/name": name, **labels}}


def _env(values: Values, **extra: str) -> list[dict[str, Any]]:
    env = {"KILN_BOOTSTRAP_SERVERS": values.bootstrap_servers, "KILN_BLOB_STORE": values.blob_store,
           "KILN_GRACE_S": f"{values.grace_s:g}", "KILN_METRICS_HOST": "0.0.0.0",
           "KILN_METRICS_PORT": str(values.metrics_port), **extra}
    if values.s3_endpoint:
        env["KILN_S3_ENDPOINT"] = values.s3_endpoint
    return [{"name": k, "value": v} for k, v in env.items()]


def _container(name: str, values: Values, args: list[str], port: int, probe_path: str, *, cpu: str, memory: str,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    probe = {"httpGet": {"path": probe_path, "port": port}, "periodSeconds": 10, "failureThreshold": 3}
    limits = {"cpu": cpu, "memory": memory} if values.cpu_limits else {"memory": memory}
    return {
        "name": name, "image": values.image, "imagePullPolicy": values.image_pull_policy, "args": args,
        "env": _env(values, **values.env, **(env or {})),
        "envFrom": [{"secretRef": {"name": values.s3_secret, "optional": True}}],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": probe, "livenessProbe": {**probe, "initialDelaySeconds": 30},
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": limits},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def _pod_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _engine(values: Values) -> dict[str, Any]:
    mounts = [{"name": "engine-socket", "mountPath": ENGINE_SOCKET_DIR}, {"name": "exec-dirs", "mountPath": EXEC_DIRS}]
    if values.engine_rootful:  # its images and containers on an emptyDir: overlay2 does not stack on overlay
        mounts.append({"name": "engine-data", "mountPath": "/var/lib/docker"})
    return {"name": "engine", "image": values.engine_image, "imagePullPolicy": values.image_pull_policy,
            "env": [{"name": "DOCKER_HOST", "value": f"unix://{ENGINE_SOCKET_DIR}/docker.sock"}],
            "args": ["--host", f"unix://{ENGINE_SOCKET_DIR}/docker.sock", *values.engine_args],
            "restartPolicy": "Always",  # a native sidecar (module docstring)
            # Started once dockerd answers on the pod's socket (up to 5 minutes on a loaded node).
            "startupProbe": {"exec": {"command": ["docker", "version"]}, "periodSeconds": 2, "timeoutSeconds": 10,
                             "failureThreshold": 150},
            "securityContext": {"privileged": True, "runAsUser": 0 if values.engine_rootful else 1000},
            "volumeMounts": mounts}


def worker_pod(stage: str, sv: StageValues, values: Values, *, spare: bool = False) -> dict[str, Any]:
    cpu = sv.cpu or ("1" if spare else str(sv.slots))
    args = ["worker", stage] if spare else ["worker", stage, "--slots", str(sv.slots)]
    extra = {**sv.env, **({"KILN_CPU_FRACTION": f"{values.spare_cpu.cpu_fraction:g}"} if spare else {})}
    memory = f"{sv.memory_per_slot_mib * (1 if spare else sv.slots)}Mi"
    worker = _container("worker", values, args, values.metrics_port, "/healthz", cpu=cpu, memory=memory, env=extra)
    if spare:
        worker["resources"]["limits"].pop("cpu", None)  # it may use its fraction of the node's idle CPUs
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": int(values.grace_s) + 60, "containers": [worker],
                            "automountServiceAccountToken": False}
    if spare:
        spec["nodeSelector"] = dict(values.spare_cpu.node_label)
        spec["priorityClassName"] = "kiln-spare-cpu"
    else:
        key, value = next(iter(values.preemptible_label.items()))
        spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchExpressions": [
                {"key": key, "operator": "In", "values": [value]}]}}]}}
        spec["tolerations"] = [{"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}]
    if sv.container_engine:
        worker["env"].append({"name": "DOCKER_HOST", "value": f"unix://{ENGINE_SOCKET_DIR}/docker.sock"})
        worker["volumeMounts"] = [{"name": "engine-socket", "mountPath": ENGINE_SOCKET_DIR},
                                  {"name": "exec-dirs", "mountPath": EXEC_DIRS}]
        spec["initContainers"] = [_engine(values)]
        spec["shareProcessNamespace"] = True
        spec["volumes"] = [{"name": "engine-socket", "emptyDir": {}}, {"name": "exec-dirs", "emptyDir": {}}]
        if values.engine_rootful:
            spec["volumes"].append({"name": "engine-data", "emptyDir": {}})
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **values.sandbox_label}
        spec.setdefault("tolerations", []).extend({"key": k, "operator": "Equal", "value": v, "effect": "NoSchedule"}
                                                  for k, v in values.sandbox_label.items())
    labels = {"kiln.dev/stage": stage, "kiln.dev/engine": str(sv.container_engine).lower()}
    return {"metadata": {"labels": labels, "annotations": _pod_annotations(values.metrics_port)}, "spec": spec}


def _workload(kind: str, name: str, pod: dict[str, Any], values: Values, replicas: int | None = None) -> Manifest:
    selector = {"matchLabels": {"app.kubernetes.io/name": name}}
    pod["metadata"]["labels"]["app.kubernetes.io/name"] = name
    spec: dict[str, Any] = {"selector": selector, "template": pod}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": _meta(name, values), "spec": spec}


def _service(name: str, port: int, values: Values) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, values),
            "spec": {"selector": {"app.kubernetes.io/name": name}, "ports": [{"name": "http", "port": port,
                                                                              "targetPort": port}]}}


def _scaled_object(stage: str, sv: StageValues, values: Values) -> Manifest:
    url = f"http://kiln-autoscaler.{values.namespace}.svc:{AUTOSCALER_PORT}/keda/{stage}"
    spec: dict[str, Any] = {
        "scaleTargetRef": {"name": f"kiln-worker-{stage}"}, "minReplicaCount": sv.min_workers,
        "maxReplicaCount": sv.max_workers, "pollingInterval": values.polling_interval_s,
        "triggers": [{"type": "metrics-api", "metricType": "AverageValue",
                      "metadata": {"url": url, "valueLocation": "desired", "targetValue": "1"}},
                     # The worker's CPU alone: the engine sidecar requests none (its sandboxes have their
                     # own limits), and a pod's utilization with an unrequested container is undefined -- the HPA
                     # then never scales down.
                     {"type": "cpu", "metricType": "Utilization",
                      "metadata": {"value": str(values.cpu_target_percent), "containerName": "worker"}}]}
    if values.scale_down_window_s is not None:
        spec["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
            "stabilizationWindowSeconds": values.scale_down_window_s}}}}
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(f"kiln-worker-{stage}", values),
            "spec": spec}


def _service_deployment(name: str, args: list[str], port: int, probe: str, values: Values) -> list[Manifest]:
    container = _container(name.removeprefix("kiln-"), values, args, port, probe, cpu=values.service_cpu,
                           memory=f"{values.service_memory_mib}Mi")
    pod = {"metadata": {"labels": {}, "annotations": _pod_annotations(port)},
           "spec": {"containers": [container], "automountServiceAccountToken": False}}
    return [_workload("Deployment", name, pod, values, replicas=1), _service(name, port, values)]


def _network_policies(values: Values) -> list[Manifest]:
    allowed = [{"to": [{"ipBlock": {"cidr": cidr}} for cidr in values.control_plane_cidrs],
                "ports": [{"protocol": "TCP", "port": p} for p in values.control_plane_ports]},
               {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": _meta("kiln-engine-pods", values),
             "spec": {"podSelector": {"matchLabels": {"kiln.dev/engine": "true"}},
                      "policyTypes": ["Ingress", "Egress"], "egress": allowed,
                      "ingress": [{"ports": [{"protocol": "TCP", "port": values.metrics_port}]}]}}]


def _prometheus(values: Values) -> Manifest:
    scrape = (
        "scrape_configs:\n"
        "  - job_name: kiln-pods\n"
        "    kubernetes_sd_configs: [{role: pod, namespaces: {names: [" + values.namespace + "]}}]\n"
        "    relabel_configs:\n"
        "      - {source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape], action: keep,\n"
        "         regex: 'true'}\n"
        "      - {source_labels: [__address__, __meta_kubernetes_pod_annotation_prometheus_io_port], action: replace,\n"
        "         regex: '([^:]+)(?::\\d+)?;(\\d+)', replacement: '$1:$2', target_label: __address__}\n"
        "      - {source_labels: [__meta_kubernetes_pod_label_kiln_dev_stage], target_label: stage}\n")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta("kiln-prometheus", values),
            "data": {"prometheus.yml": scrape}}


def render(values: Values, specs: list[StageSpec]) -> list[Manifest]:
    """Every object of a deployment running the stages of ``specs`` (the registered ones), each stage's pods as its
    spec asks (``StageSpec.deployment``) unless the values say otherwise."""
    out: list[Manifest] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": values.namespace, "labels": {"app.kubernetes.io/part-of": "kiln"}}}]
    by_kind = {s.kind: s for s in specs}
    stages = sorted(by_kind)
    for stage in stages:
        sv = stage_values(values, by_kind[stage])
        out.append(_workload("Deployment", f"kiln-worker-{stage}", worker_pod(stage, sv, values), values,
                             replicas=sv.min_workers))
        out.append(_scaled_object(stage, sv, values))
    for stage in spare_cpu_stages(values, specs):
        sv = stage_values(values, by_kind[stage]) if stage in by_kind else values.stages.get(stage, StageValues())
        out.append(_workload("DaemonSet", f"kiln-spare-{stage}", worker_pod(stage, sv, values, spare=True), values))
    out.append({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": "kiln-spare-cpu", "labels": {"app.kubernetes.io/part-of": "kiln"}},
                "value": -10, "preemptionPolicy": "Never",
                "description": "Workers on borrowed CPUs of other machines yield to the machines' own work."})
    slots_of = [f"--slots-of={s}={stage_values(values, by_kind[s]).slots}" for s in stages]
    out += _service_deployment("kiln-autoscaler", ["autoscale", "run", *stages, "--backend", "keda",
                                                   "--stats-url", f"http://kiln-stats.{values.namespace}.svc:"
                                                   f"{STATS_PORT}", "--goal-minutes", f"{values.goal_minutes:g}",
                                                   "--tick-s", f"{values.autoscaler_tick_s:g}",
                                                   "--host", "0.0.0.0", "--port", str(AUTOSCALER_PORT), *slots_of],
                               AUTOSCALER_PORT, "/healthz", values)
    out += _service_deployment("kiln-stats", ["stats", "serve"], STATS_PORT, "/healthz", values)
    out[-2]["spec"]["template"]["spec"]["containers"][0]["env"] += [
        {"name": "KILN_STATS_HOST", "value": "0.0.0.0"}, {"name": "KILN_STATS_PORT", "value": str(STATS_PORT)}]
    out += _service_deployment("kiln-saucer", ["saucer", "serve", "--host", "0.0.0.0", "--port", str(SAUCER_PORT)],
                               SAUCER_PORT, "/healthz", values)
    out[-2]["spec"]["template"]["spec"]["containers"][0]["env"].append(  # it refuses a non-loopback bind without one
        {"name": "KILN_SAUCER_TOKEN", "valueFrom": {"secretKeyRef": {"name": "kiln-saucer", "key": "token"}}})
    out += _network_policies(values)
    out.append(_prometheus(values))
    return out
