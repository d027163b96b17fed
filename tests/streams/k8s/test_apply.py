"""The render applied to a real control plane: ``kubectl apply --dry-run=server`` against kube-apiserver v1.32 on
etcd with KEDA's CRDs (infra/k8s/cluster.sh control-plane), so admission, defaulting and the CRDs' schemas judge every
object as a cluster would. Skipped where the binaries are not built (``cluster.sh install``: about an hour cold);
the full smoke on a running node is ``bench/k8s.py``."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kiln.streams.k8s.render import Manifest, render
from kiln.streams.k8s.values import Values
from kiln.streams.stage import stage_specs

ROOT = Path(__file__).parents[3]
CLUSTER = ROOT / "infra" / "k8s" / "cluster.sh"


def _cluster(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(CLUSTER), *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def apiserver() -> Iterator[None]:
    """etcd + kube-apiserver + KEDA's CRDs, started for this module unless a cluster already runs (then kept)."""
    versions = dict(line.split("\t")[0::2] for line in _cluster("versions").stdout.splitlines())
    if versions.get("kube-apiserver") != "cached" or versions.get("kubectl") != "cached":
        pytest.skip(f"kube-apiserver/kubectl not built ({CLUSTER} install)")
    if subprocess.run(["sh", "-c", "command -v etcd"], capture_output=True, check=False).returncode != 0:
        pytest.skip(f"no etcd ({CLUSTER} install: Debian's etcd-server)")
    running = _cluster("kubectl", "get", "--raw", "/readyz").returncode == 0
    started = _cluster("control-plane", timeout=300)
    assert started.returncode == 0, started.stderr[-3000:]
    # The namespace for real: a server-side dry run stores nothing, and namespaced objects need theirs.
    made = _apply(_docs(Values())[:1])
    assert made.returncode == 0, made.stderr
    yield
    if not running:
        _cluster("down", timeout=300)


def _docs(values: Values) -> list[Manifest]:
    return render(values, list(stage_specs().values()))


def _apply(docs: list[Manifest], *extra: str) -> subprocess.CompletedProcess[str]:
    return _cluster("kubectl", "apply", *extra, "-f", "-", stdin=yaml.safe_dump_all(docs, sort_keys=False))


def test_the_render_is_accepted_by_a_real_apiserver(apiserver: None) -> None:
    values = Values.model_validate(yaml.safe_load((ROOT / "infra/k8s/values.yaml").read_text()))
    docs = _docs(values)
    assert docs[0]["kind"] == "Namespace"
    applied = _apply(docs, "--dry-run=server")
    assert applied.returncode == 0, applied.stderr
    lines = applied.stdout.splitlines()
    assert len(lines) == len(docs), applied.stdout
    assert all(line.endswith("(server dry run)") for line in lines), applied.stdout
    kinds = {line.split("/")[0] for line in lines}
    assert {"deployment.apps", "scaledobject.keda.sh", "daemonset.apps", "service", "networkpolicy.networking.k8s.io",
            "priorityclass.scheduling.k8s.io", "configmap", "namespace"} <= kinds, kinds
    # The rootful engine (cgroup-v1 nodes) and the smoke's shrunk requests are accepted as well.
    shrunk = Values(engine_rootful=True, cpu_limits=False, service_cpu="50m", scale_down_window_s=30,
                    stages={"exec": {"cpu": "100m", "max_workers": 3, "env": {"KILN_EXEC_WARM": "0"}}})
    again = _apply(_docs(shrunk), "--dry-run=server")
    assert again.returncode == 0, again.stderr


def test_the_apiserver_refuses_what_the_schemas_refuse(apiserver: None) -> None:
    """The dry run judges: KEDA's CRD refuses a ScaledObject with a wrong type, the API a Deployment with an
    unknown field (kubectl's server-side field validation is strict)."""
    docs = _docs(Values())
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    scaled["spec"]["maxReplicaCount"] = "many"
    refused = _apply([scaled], "--dry-run=server")
    assert refused.returncode != 0 and "maxReplicaCount" in refused.stderr, refused.stderr
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    refused = _apply([deployment], "--dry-run=server")
    assert refused.returncode != 0 and "imagePullPolicy2" in refused.stderr, refused.stderr
