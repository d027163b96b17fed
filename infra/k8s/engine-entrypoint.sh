#!/bin/bash
# The rootful engine sidecar (engine-rootful.Dockerfile): dockerd, then kiln's egress proxy on it. dockerd's arguments
# are the render's (--host on the pod's shared socket directory, then values.engine_args). The socket's group is the
# worker's (gid 1000); the data root is an emptyDir (overlay2 cannot stack on the container's own overlay root);
# sandboxes get no network (--bridge=none; kiln runs them with --network none) and no new privileges.
# Build steps run on this engine's `kiln-egress` network, whose only reachable address is the allowlisting proxy:
# infra/egress/egress.sh start, run here as on the host and in infra/nodes' nodes — the network on this engine, the
# packet filter in the pod's network namespace (nothing forwarded off the bridge, so no loopback, pod or
# control-plane address), tinyproxy as its own user, refused every private range. Fails closed: without the proxy
# the sidecar exits (the builder refuses to build without the network anyway).
set -euo pipefail
socket=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ ${args[i]} == --host ]] && socket=${args[i + 1]#unix://}
done
[[ -n $socket ]] || { echo "kiln-engine: no --host unix://SOCKET argument" >&2; exit 2; }
dockerd --group 1000 --data-root /var/lib/docker --bridge=none --iptables=false --ip6tables=false \
  --ip-masq=false --userland-proxy=false --no-new-privileges "$@" &
engine=$!
# The render runs this container as a native sidecar: on a pod's deletion (scale-down, rollout, preemption) the
# kubelet sends SIGTERM here only once the worker, whose jobs run on this engine, has drained and exited.
stopping=0
trap 'stopping=1' TERM INT
stop() {
  kill -TERM "$engine" 2>/dev/null
  wait "$engine" || true
  exit 0
}
for _ in $(seq 1 300); do
  [[ -S $socket ]] && docker -H "unix://$socket" version >/dev/null 2>&1 && break
  kill -0 "$engine" 2>/dev/null || { wait "$engine"; exit $?; }
  ((stopping)) && stop
  sleep 0.2
done
KILN_EGRESS_DATA=/run/kiln-egress DOCKER_HOST="unix://$socket" bash /opt/kiln/infra/egress/egress.sh start \
  || { echo "kiln-engine: the egress proxy did not start: no builds here" >&2; kill -TERM "$engine"; wait "$engine" || true; exit 1; }
until ((stopping)); do
  kill -0 "$engine" 2>/dev/null || { wait "$engine"; exit $?; }
  sleep 1
done
stop
