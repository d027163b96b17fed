"""The Kubernetes manifests render for every registered stage and validate against the Kubernetes API's own
OpenAPI schemas (kubernetes-validate, strict) and KEDA's ScaledObject CRD schema from its Go module."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kiln.streams.k8s.render import render
from kiln.streams.k8s.values import Values
from kiln.streams.settings import KilnSettings
from kiln.streams.stage import stage_specs

K8S_VERSION = "1.37.0"
KEDA_VERSION = "v2.21.0"
ROOT = Path(__file__).parents[3]


@pytest.fixture(scope="session")
def scaled_object_schema() -> dict[str, Any]:
    """KEDA's ScaledObject CRD (v1alpha1 schema), from the Go module proxy once, cached by version."""
    cached = KilnSettings().cache / f"keda-crd-{KEDA_VERSION}" / "keda.sh_scaledobjects.yaml"
    if not cached.exists():
        proxy = os.environ.get("GOPROXY", "https://proxy.golang.org").split(",")[0]
        with urllib.request.urlopen(f"{proxy}/github.com/kedacore/keda/v2/@v/{KEDA_VERSION}.zip", timeout=120) as r:
            archive = zipfile.ZipFile(io.BytesIO(r.read()))
        name = f"github.com/kedacore/keda/v2@{KEDA_VERSION}/config/crd/bases/keda.sh_scaledobjects.yaml"
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_bytes(archive.read(name))
    crd = yaml.safe_load(cached.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return dict(version["schema"]["openAPIV3Schema"])


def _manifests(values: Values) -> list[dict[str, Any]]:
    # through YAML, as kubectl would get them
    return list(yaml.safe_load_all(yaml.safe_dump_all(render(values, list(stage_specs().values())))))


def _validate(doc: dict[str, Any], scaled_object_schema: dict[str, Any]) -> None:
    if doc["kind"] == "ScaledObject":
        jsonschema.validate(doc, scaled_object_schema)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_validates(scaled_object_schema: dict[str, Any]) -> None:
    docs = _manifests(Values.model_validate(yaml.safe_load((ROOT / "infra/k8s/values.yaml").read_text())))
    for doc in docs:
        _validate(doc, scaled_object_schema)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for stage in stage_specs():
        assert ("Deployment", f"kiln-worker-{stage}") in kinds and ("ScaledObject", f"kiln-worker-{stage}") in kinds
    assert {("DaemonSet", "kiln-spare-lean"), ("Deployment", "kiln-autoscaler"), ("Deployment", "kiln-stats"),
            ("Deployment", "kiln-saucer"), ("NetworkPolicy", "kiln-engine-pods")} <= kinds


def test_a_broken_manifest_is_refused(scaled_object_schema: dict[str, Any]) -> None:
    """The validators do reject: an unknown field, a wrong type, a trigger without its type."""
    deployment, scaled = (next(d for d in _manifests(Values()) if d["kind"] == kind)
                          for kind in ("Deployment", "ScaledObject"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, scaled_object_schema)
    scaled["spec"]["maxReplicaCount"] = "many"
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled, scaled_object_schema)


def test_workers_drain_on_preemptible_nodes_and_never_touch_the_node() -> None:
    values = Values()
    docs = _manifests(values)
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment",
                                                                                                "DaemonSet")}
    engines = 0
    for name, pod in pods.items():
        assert all("hostPath" not in v for v in pod.get("volumes", [])), name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            where, security = f"{name}/{container['name']}", container.get("securityContext", {})
            assert "hostPort" not in str(container.get("ports", [])), where
            if security.get("privileged"):
                # The one privileged container is the rootless engine sidecar (render.py's module docstring): its
                # daemon runs as uid 1000, in a pod labelled as having an engine, only on the tainted sandbox pool.
                engines += 1
                labels = next(d for d in docs if d["metadata"]["name"] == name)["spec"]["template"]["metadata"]
                assert container["name"] == "engine" and container["image"] == values.engine_image, where
                assert security.get("runAsUser") == 1000, where
                assert labels["labels"]["kiln.dev/engine"] == "true", where
                assert pod.get("nodeSelector", {}).items() >= values.sandbox_label.items(), where
                assert {(t["key"], t["value"], t["effect"]) for t in pod["tolerations"]} >= {
                    (k, v, "NoSchedule") for k, v in values.sandbox_label.items()}, where
            else:  # everything else: not root, no capabilities, no way to gain privileges
                assert security == {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}}, where
        if name.startswith("kiln-worker-"):
            assert pod["terminationGracePeriodSeconds"] > values.grace_s
            assert pod["tolerations"][0]["key"] == "cloud.google.com/gke-preemptible"
            assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert engines == sum(1 for s in stage_specs().values() if s.deployment.container_engine) >= 2  # build and exec
    build = pods["kiln-worker-build"]
    assert [c["name"] for c in build["containers"]] == ["worker"] and build["shareProcessNamespace"]
    # The engine is a native sidecar: the worker starts once it answers, and outlives the worker on a deletion.
    engine = build["initContainers"][0]
    assert engine["name"] == "engine" and engine["restartPolicy"] == "Always"
    assert engine["startupProbe"]["exec"]["command"] == ["docker", "version"]
    assert build["containers"][0]["resources"]["requests"]["cpu"] == "2"  # from its slots
    spare = pods["kiln-spare-lean"]["containers"][0]
    assert "--slots" not in spare["args"]
    assert {"name": "KILN_CPU_FRACTION", "value": "0.25"} in spare["env"]
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"kiln.dev/engine": "true"}
    assert all(rule["to"][0]["ipBlock"]["cidr"] == "10.0.0.0/8" for rule in policy["spec"]["egress"] if "to" in rule)


def test_scaled_objects_combine_the_queue_minimum_with_cpu() -> None:
    for doc in (d for d in _manifests(Values()) if d["kind"] == "ScaledObject"):
        stage = doc["metadata"]["name"].removeprefix("kiln-worker-")
        metrics_api, cpu = doc["spec"]["triggers"]
        assert metrics_api["type"] == "metrics-api" and metrics_api["metadata"]["url"].endswith(f"/keda/{stage}")
        assert metrics_api["metadata"]["valueLocation"] == "desired" and cpu["type"] == "cpu"


def test_spare_cpu_slots_are_a_fraction_of_the_cpus() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert KilnSettings(cpu_fraction=0.5).job_slots() == max(1, int(cpus * 0.5))
    assert KilnSettings(cpu_fraction=0.5, slots=7).job_slots() == 7


def test_each_stage_states_its_pods_and_values_override_a_field() -> None:
    """The runtime names no stage: build and exec ask for a container engine and Lean for spare CPUs in their specs;
    a values file overrides a field and keeps the stage's others."""
    specs = stage_specs()
    assert {k for k, s in specs.items() if s.deployment.container_engine} == {"build", "exec"}
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _manifests(Values(stages={"exec": {"max_workers": 40}},
                                                                             spare_cpu={"stages": []}))}
    exec_pod = docs[("Deployment", "kiln-worker-exec")]["spec"]["template"]["spec"]
    assert [c["name"] for c in exec_pod["containers"]] == ["worker"]
    assert [c["name"] for c in exec_pod["initContainers"]] == ["engine"]
    assert exec_pod["containers"][0]["args"][-2:] == ["--slots", "4"]  # the stage's, kept
    assert docs[("ScaledObject", "kiln-worker-exec")]["spec"]["maxReplicaCount"] == 40
    assert ("DaemonSet", "kiln-spare-lean") not in docs
    assert "kiln-spare-lean" in {d["metadata"]["name"] for d in _manifests(Values())}


def test_the_options_a_one_node_cluster_needs() -> None:
    """What `bench/k8s.py` sets to fit 2 CPUs on a cgroup-v1 node: the namespace comes first; a rootful engine is
    root only in the engine sidecar (privileged, its data on an emptyDir), still only on the sandbox pool; requests
    without CPU limits; KEDA's polling and the HPA's scale-down window; per-stage environment."""
    values = Values(engine_rootful=True, engine_args=["--insecure-registry", "10.244.0.1:59500"], cpu_limits=False,
                    image_pull_policy="Never", polling_interval_s=10, scale_down_window_s=30, autoscaler_tick_s=10,
                    stages={"exec": {"cpu": "100m", "env": {"KILN_EXEC_WARM": "0"}}})
    docs = _manifests(values)
    assert docs[0] == {"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": "kiln", "labels": {"app.kubernetes.io/part-of": "kiln"}}}
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pod = by_name[("Deployment", "kiln-worker-exec")]["spec"]["template"]["spec"]
    (worker,), (engine,) = pod["containers"], pod["initContainers"]
    assert engine["securityContext"] == {"privileged": True, "runAsUser": 0}
    assert engine["args"][-2:] == ["--insecure-registry", "10.244.0.1:59500"]
    assert {"name": "engine-data", "mountPath": "/var/lib/docker"} in engine["volumeMounts"]
    assert {"name": "engine-data", "emptyDir": {}} in pod["volumes"]
    assert pod["nodeSelector"].items() >= values.sandbox_label.items()
    assert worker["resources"] == {"requests": {"cpu": "100m", "memory": "8192Mi"}, "limits": {"memory": "8192Mi"}}
    assert {"name": "KILN_EXEC_WARM", "value": "0"} in worker["env"] and worker["imagePullPolicy"] == "Never"
    assert all(c["securityContext"]["runAsUser"] == 1000 for d in docs if d["kind"] in ("Deployment", "DaemonSet")
               for c in d["spec"]["template"]["spec"]["containers"] if c["name"] != "engine")
    scaled = by_name[("ScaledObject", "kiln-worker-exec")]["spec"]
    assert scaled["pollingInterval"] == 10
    assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 30}
    assert scaled["triggers"][1]["metadata"]["containerName"] == "worker"
    autoscaler = by_name[("Deployment", "kiln-autoscaler")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert autoscaler[autoscaler.index("--tick-s") + 1] == "10"
    assert "advanced" not in next(d for d in _manifests(Values()) if d["kind"] == "ScaledObject")["spec"]


def test_every_rendered_stage_starts_without_the_rl_extra() -> None:
    """Each stage Deployment runs kiln's worker image, which has the worker and ops extras, not the rl extra (torch,
    several GB): every registered stage's handler module imports with torch and transformers absent (the rollout
    stage only samples over HTTP; the trainer's weight updates are what need torch)."""
    modules = sorted({spec.handler.partition(":")[0] for spec in stage_specs().values()})
    assert "kiln.workers.rollout.stage" in modules
    script = ("import importlib, sys\n"
              "for name in ('torch', 'transformers', 'trl', 'safetensors'):\n"
              "    sys.modules[name] = None\n"
              f"for module in {modules!r}:\n"
              "    importlib.import_module(module)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
