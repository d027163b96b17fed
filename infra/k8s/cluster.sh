#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, built from public Go modules and Debian packages, nothing pulled
# from a hub or registry.k8s.io; kiln's rendered manifests are applied to it (`kiln k8s render | kubectl apply`).
#   cluster.sh install        Debian's etcd-server, containerd, runc and CNI plugins; kube-apiserver, -controller-
#                             manager, -scheduler, kubelet, kube-proxy and kubectl from k8s.io/kubernetes (a module
#                             of our own pins its staging modules by `replace`); CoreDNS, metrics-server and KEDA
#                             (operator, metrics API server, CRDs) from their Go modules. Cached by version in
#                             $KILN_CACHE/k8s-<version>/bin: a binary whose --version (or embedded module version)
#                             is the pinned one is never rebuilt; cold build times go to build-times.tsv there.
#   cluster.sh versions       each binary, its pinned version, cached or missing
#   cluster.sh images         every image a pod needs, built here and imported into the cluster's containerd: the
#                             pause image, CoreDNS, metrics-server, KEDA's two, the engine sidecar (KILN_K8S_ENGINE:
#                             rootful, default, or rootless) and kiln's worker image (+ bubblewrap and the fake Lean
#                             REPL, which says it is one); skipped when containerd has the tag. Prints name=ref lines.
#   cluster.sh refs           the name=ref lines `images` would print, without building or importing
#   cluster.sh control-plane  etcd + kube-apiserver (+ KEDA's CRDs): enough for `kubectl apply --dry-run=server`
#   cluster.sh up             the control plane, controller manager, scheduler, containerd, kubelet, kube-proxy,
#                             then CoreDNS, metrics-server and KEDA; waits until the node is Ready and each is
#                             Available (idempotent)
#   cluster.sh down           every pod deleted (so its network is torn down), every process stopped, the
#                             cluster's state wiped (etcd, kubelet); binaries, images and certificates are kept
#   cluster.sh status         each process, the node, the add-ons
#   cluster.sh kubectl ARGS…  kubectl against this cluster
#   cluster.sh push LOCAL REMOTE  a Docker-engine image pushed through containerd to a plain-HTTP registry
#   cluster.sh env            KUBECONFIG=…, the host's address on the pods' bridge, the CIDRs (shell assignments)
# Env: KILN_K8S_API_PORT (6443), KILN_K8S_ETCD_PORT (2379; its peer port +1), KILN_K8S_POD_CIDR (10.244.0.0/16;
#      the node gets its first /24, the host is .1 of it on the bridge kiln-k8s0: where pods reach Kafka, S3 and the
#      registry), KILN_K8S_SERVICE_CIDR (10.96.0.0/16), KILN_K8S_ENGINE (rootful|rootless).
# Processes run on the host (no systemd here); pods get the cgroupfs driver on this cgroup-v1 host.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

K8S_VERSION=v1.32.3
STAGING_VERSION=v0.32.3
COREDNS_VERSION=v1.11.3
METRICS_SERVER_VERSION=v0.8.0
KEDA_VERSION=v2.16.1
CACHE="$KILN_CACHE/k8s-$K8S_VERSION"
BIN="$CACHE/bin"
API_PORT="${KILN_K8S_API_PORT:-6443}"
ETCD_PORT="${KILN_K8S_ETCD_PORT:-2379}"
POD_CIDR="${KILN_K8S_POD_CIDR:-10.244.0.0/16}"
SERVICE_CIDR="${KILN_K8S_SERVICE_CIDR:-10.96.0.0/16}"
ENGINE_MODE="${KILN_K8S_ENGINE:-rootful}"
[[ $ENGINE_MODE == rootful || $ENGINE_MODE == rootless ]] || die "KILN_K8S_ENGINE is rootful or rootless"
POD_PREFIX="${POD_CIDR%.*.*}"                     # 10.244
NODE_SUBNET="$POD_PREFIX.0.0/24"
HOST_ADDRESS="$POD_PREFIX.0.1"
SERVICE_PREFIX="${SERVICE_CIDR%.*.*}"
API_SERVICE_IP="$SERVICE_PREFIX.0.1"
DNS_SERVICE_IP="$SERVICE_PREFIX.0.10"
BRIDGE=kiln-k8s0
NODE_NAME=kiln-k8s
CNI_NETWORK=kiln-k8s
RUN="$KILN_RUN/k8s-$API_PORT"
PKI="$RUN/pki"
LOGS="$RUN/logs"
CONTAINERD_ROOT="$RUN.containerd"                 # kept by `down`: the imported images stay
CONTAINERD_STATE=/run/kiln-k8s/containerd
CONTAINERD_SOCK="$CONTAINERD_STATE/containerd.sock"
KUBECONFIG_FILE="$RUN/admin.kubeconfig"
CNI_BIN=/usr/lib/cni
HERE="$INFRA_DIR/k8s"
DOCKER="${KILN_DOCKER_CLI:-$(command -v /usr/bin/docker || command -v docker || echo docker)}"

kubectl_() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"; }
ctr_() { ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# --- install: binaries by version ----------------------------------------------------------------------------------

# timed NAME COMMAND…: run it and append its wall time to build-times.tsv (the cold figures of a first install).
timed() {
  local name=$1 began=$SECONDS; shift
  "$@"
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - began))" "$(date -u +%FT%TZ)" >>"$CACHE/build-times.tsv"
}

# has_version BINARY VERSION [MODULE]: the cached binary is that version: its --version, or (a binary built from a
# module's source tree says "(devel)") its embedded main module is MODULE and that version's tree is the cached one.
has_version() {
  local bin="$BIN/$1" want=$2 module=${3:-}
  [[ -x $bin ]] || return 1
  case $1 in
    kubectl) [[ $("$bin" version --client 2>/dev/null) == *"Client Version: $want"* ]] ;;
    kube-*|kubelet) [[ $("$bin" --version 2>/dev/null) == "Kubernetes $want" ]] ;;
    coredns) [[ $("$bin" -version 2>/dev/null) == *"CoreDNS-${want#v}"* ]] ;;
    pause) [[ $("$bin" -v 2>/dev/null) == *"$want"* ]] ;;
    *) [[ -d $CACHE/src-${module//\//_}_$want && $(go version -m "$bin" 2>/dev/null) == *$'\tmod\t'"$module"$'\t'* ]] ;;
  esac
}

# The module of our own that builds Kubernetes' commands: k8s.io/kubernetes requires its 31 staging modules at
# v0.0.0 (replaced by ./staging in its own tree); here each is pinned to its release by `replace`.
kubernetes_module() {
  local src="$CACHE/src"
  [[ -f $src/.tidied ]] && return 0
  mkdir -p "$src"
  local started=$SECONDS gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  printf 'kubernetes-download\t%s\t%s\n' "$((SECONDS - started))" "$(date -u +%FT%TZ)" >>"$CACHE/build-times.tsv"
  (cd "$src" && rm -f go.mod go.sum && go mod init kiln.dev/k8s-build >/dev/null 2>&1)
  printf '//go:build tools\n\npackage tools\n\nimport (\n' >"$src/tools.go"
  for cmd in kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet kube-proxy; do
    printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$cmd" >>"$src/tools.go"
  done
  printf ')\n' >>"$src/tools.go"
  local edits=(-require "k8s.io/kubernetes@$K8S_VERSION")
  for module in $(sed -n 's:^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*:\1:p' "$gomod"); do
    edits+=(-replace "$module=$module@$STAGING_VERSION")
  done
  (cd "$src" && go mod edit "${edits[@]}" && go mod tidy >&2)
  sha256sum "$src/go.mod" | cut -c1-16 >"$src/.tidied"
}

build_kubernetes() {
  local cmd=$1
  has_version "$cmd" "$K8S_VERSION" && return 0
  kubernetes_module
  local pkg="github.com/kubernetes/kubernetes" ldflags
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1"
  ldflags+=" -X k8s.io/component-base/version.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION")"
  ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  log "building $cmd $K8S_VERSION from k8s.io/kubernetes (minutes, once; $pkg)"
  (cd "$CACHE/src" && timed "$cmd" env CGO_ENABLED=0 GOCACHE="$CACHE/gocache" \
    go build -trimpath -ldflags "$ldflags" -o "$BIN/$cmd" "k8s.io/kubernetes/cmd/$cmd")
}

# module_source MODULE VERSION: the module's tree, copied writable from the module cache (a build of its main
# package needs its own go.mod and replaces, not ours).
module_source() {
  local module=$1 version=$2 dir="$CACHE/src-${1//\//_}_$2"
  if [[ ! -f $dir/go.mod ]]; then
    local zipdir
    zipdir=$(go mod download -json "$module@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
    rm -rf "$dir" && cp -r "$zipdir" "$dir" && chmod -R u+w "$dir"
  fi
  echo "$dir"
}

build_module() {
  local name=$1 module=$2 version=$3 pkg=$4 dir
  has_version "$name" "$version" "$module" && return 0
  dir=$(module_source "$module" "$version")
  log "building $name $version from $module (minutes, once)"
  (cd "$dir" && timed "$name" env CGO_ENABLED=0 GOCACHE="$CACHE/gocache" GOFLAGS=-mod=mod \
    go build -trimpath -ldflags "-s -w" -o "$BIN/$name" "$pkg")
}

build_pause() {
  has_version pause "$K8S_VERSION" && return 0
  local src
  src=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  timed pause gcc -Os -static -DVERSION="$K8S_VERSION" -o "$BIN/pause" "$src/build/pause/linux/pause.c"
}

keda_crds() {
  local dir="$CACHE/keda-$KEDA_VERSION/crds"
  [[ -f $dir/.complete ]] && return 0
  mkdir -p "$dir"
  cp "$(module_source github.com/kedacore/keda/v2 "$KEDA_VERSION")"/config/crd/bases/*.yaml "$dir/"
  touch "$dir/.complete"
}

install() {
  apt_install etcd-server containerd runc containernetworking-plugins iptables conntrack openssl gcc libc6-dev
  mkdir -p "$BIN"
  local cmd
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy; do
    build_kubernetes "$cmd"
  done
  build_module coredns github.com/coredns/coredns "$COREDNS_VERSION" .
  build_module metrics-server sigs.k8s.io/metrics-server "$METRICS_SERVER_VERSION" ./cmd/metrics-server
  build_module keda github.com/kedacore/keda/v2 "$KEDA_VERSION" ./cmd/operator
  build_module keda-adapter github.com/kedacore/keda/v2 "$KEDA_VERSION" ./cmd/adapter
  build_pause
  keda_crds
  log "kubernetes $K8S_VERSION binaries ready in $BIN"
}

# versions: each binary, the version it must be, and whether the cached one is it (install builds those that are not).
versions() {
  local row name version module
  for row in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy pause; do
    printf '%s\t%s\t%s\n' "$row" "$K8S_VERSION" "$(has_version "$row" "$K8S_VERSION" && echo cached || echo missing)"
  done
  for row in "coredns $COREDNS_VERSION github.com/coredns/coredns" \
             "metrics-server $METRICS_SERVER_VERSION sigs.k8s.io/metrics-server" \
             "keda $KEDA_VERSION github.com/kedacore/keda/v2" "keda-adapter $KEDA_VERSION github.com/kedacore/keda/v2"; do
    read -r name version module <<<"$row"
    printf '%s\t%s\t%s\n' "$name" "$version" "$(has_version "$name" "$version" "$module" && echo cached || echo missing)"
  done
}

installed() {
  local cmd
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy; do
    has_version "$cmd" "$K8S_VERSION" || return 1
  done
  command -v etcd >/dev/null && command -v containerd >/dev/null && [[ -f $CACHE/keda-$KEDA_VERSION/crds/.complete ]]
}

# --- certificates and kubeconfigs ----------------------------------------------------------------------------------

# cert NAME CN [O] [SANS]: a key and a certificate signed by the cluster's CA (made once).
cert() {
  local name=$1 cn=$2 org=${3:-} sans=${4:-} subject
  [[ -s $PKI/$name.crt ]] && return 0
  subject="/CN=$cn${org:+/O=$org}"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -subj "$subject" -out "$PKI/$name.csr" 2>/dev/null
  local ext="$PKI/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=serverAuth,clientAuth"
    [[ -n $sans ]] && echo "subjectAltName=$sans"
  } >"$ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial -days 3650 \
    -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$ext"
}

kubeconfig() {
  local file=$1 user=$2
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: kiln, cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$PKI/ca.crt"}}]
users: [{name: $user, user: {client-certificate: "$PKI/$user.crt", client-key: "$PKI/$user.key"}}]
contexts: [{name: kiln, context: {cluster: kiln, user: $user}}]
current-context: kiln
EOF
}

pki() {
  mkdir -p "$PKI" && chmod 700 "$PKI"
  if [[ ! -s $PKI/ca.crt ]]; then
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -subj "/CN=kiln-k8s-ca" -days 3650 \
      -out "$PKI/ca.crt" 2>/dev/null
  fi
  if [[ ! -s $PKI/front-proxy-ca.crt ]]; then
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/front-proxy-ca.key" -subj "/CN=kiln-front-proxy-ca" \
      -days 3650 -out "$PKI/front-proxy-ca.crt" 2>/dev/null
  fi
  [[ -s $PKI/sa.key ]] || { openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null; openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null; }
  cert apiserver kube-apiserver "" "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$API_SERVICE_IP,IP:$HOST_ADDRESS"
  cert admin kiln-admin system:masters
  cert kubelet "system:node:$NODE_NAME" system:nodes
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  cert controller-manager system:kube-controller-manager
  cert scheduler system:kube-scheduler
  cert kube-proxy system:kube-proxy
  if [[ ! -s $PKI/front-proxy-client.crt ]]; then  # signed by the front proxy's CA: aggregated APIs trust it
    openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/front-proxy-client.key" -subj "/CN=front-proxy-client" \
      -out "$PKI/front-proxy-client.csr" 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' >"$PKI/fp.ext"
    openssl x509 -req -in "$PKI/front-proxy-client.csr" -CA "$PKI/front-proxy-ca.crt" -CAkey "$PKI/front-proxy-ca.key" \
      -CAcreateserial -days 3650 -extfile "$PKI/fp.ext" -out "$PKI/front-proxy-client.crt" 2>/dev/null
    rm -f "$PKI/front-proxy-client.csr" "$PKI/fp.ext"
  fi
  local user
  for user in admin kubelet controller-manager scheduler kube-proxy; do kubeconfig "$RUN/$user.kubeconfig" "$user"; done
}

# --- processes ----------------------------------------------------------------------------------------------------

# start NAME COMMAND…: run it in the background (pid in $RUN/NAME.pid, output in $LOGS/NAME.log) unless it runs.
start() {
  local name=$1; shift
  if pid_alive "$RUN/$name.pid"; then return 0; fi
  mkdir -p "$LOGS"
  log "starting $name"
  nohup "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
}

# write_if_changed FILE: standard input into FILE unless FILE holds it already (kube-proxy exits when its running
# configuration file is written, even with the same content).
write_if_changed() {
  local new; new=$(cat)
  [[ -f $1 && $(cat "$1") == "$new" ]] || printf '%s\n' "$new" >"$1"
}

api_ready() { kubectl_ get --raw /readyz >/dev/null 2>&1; }
etcd_ready() { ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$ETCD_PORT" endpoint health >/dev/null 2>&1; }

bridge() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  [[ $(ip addr show dev "$BRIDGE") == *"inet $HOST_ADDRESS/"* ]] || ip addr add "$HOST_ADDRESS/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # Service traffic between pods on the bridge passes the host's iptables (kube-proxy's rules).
  modprobe br_netfilter 2>/dev/null || true
  [[ $(cat /proc/sys/net/ipv4/ip_forward) == 1 ]] || sysctl -qw net.ipv4.ip_forward=1
  [[ ! -e /proc/sys/net/bridge/bridge-nf-call-iptables || $(cat /proc/sys/net/bridge/bridge-nf-call-iptables) == 1 ]] \
    || sysctl -qw net.bridge.bridge-nf-call-iptables=1
}

control_plane() {
  has_version kube-apiserver "$K8S_VERSION" && has_version kubectl "$K8S_VERSION" && command -v etcd >/dev/null \
    && [[ -f $CACHE/keda-$KEDA_VERSION/crds/.complete ]] || die "not installed: run '$0 install' first"
  mkdir -p "$RUN" "$LOGS"
  bridge
  pki
  start etcd etcd --name kiln-k8s --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster "kiln-k8s=http://127.0.0.1:$((ETCD_PORT + 1))" --quota-backend-bytes 2147483648
  wait_for etcd 60 etcd_ready
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --secure-port "$API_PORT" --bind-address 0.0.0.0 --advertise-address "$HOST_ADDRESS" \
    --service-cluster-ip-range "$SERVICE_CIDR" --allow-privileged=true \
    --authorization-mode Node,RBAC --client-ca-file "$PKI/ca.crt" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --requestheader-client-ca-file "$PKI/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$PKI/front-proxy-client.crt" --proxy-client-key-file "$PKI/front-proxy-client.key" \
    --kubelet-preferred-address-types InternalIP --enable-aggregator-routing=true --profiling=false
  wait_for kube-apiserver 180 api_ready
  # KEDA's CRDs: the render's ScaledObjects are checked against them even on a bare control plane.
  kubectl_ apply --server-side -f "$CACHE/keda-$KEDA_VERSION/crds" >/dev/null
  log "control plane ready: https://127.0.0.1:$API_PORT (KUBECONFIG=$KUBECONFIG_FILE)"
}

containerd_ready() { ctr_ version >/dev/null 2>&1; }

containerd_up() {
  mkdir -p "$RUN/cni/net.d" "$CONTAINERD_STATE" "$CONTAINERD_ROOT"
  cat >"$RUN/containerd.toml" <<EOF
version = 2
root = "$CONTAINERD_ROOT"
state = "$CONTAINERD_STATE"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.internal.v1.opt"]
  path = "$RUN/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/kiln/k8s-pause:$K8S_VERSION"
  # This machine's root lacks CAP_SYS_RESOURCE: runc cannot lower a container's oom_score_adj below containerd's
  # (the kubelet asks -998 for every pause container: "can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$RUN/cni/net.d"
EOF
  cat >"$RUN/cni/net.d/10-kiln.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "$CNI_NETWORK", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$NODE_SUBNET", "gateway": "$HOST_ADDRESS"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}}]}
EOF
  start containerd containerd --config "$RUN/containerd.toml"
  wait_for containerd 60 containerd_ready
}

node_cidr() { [[ -n $(kubectl_ get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}' 2>/dev/null) ]]; }
node_ready() { [[ $(kubectl_ get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]; }

up() {
  local began=$SECONDS
  installed || die "not installed: run '$0 install' first"
  control_plane
  start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$RUN/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$RUN/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$RUN/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
    --cluster-cidr "$POD_CIDR" --allocate-node-cidrs=true --node-cidr-mask-size 24 \
    --service-cluster-ip-range "$SERVICE_CIDR" --root-ca-file "$PKI/ca.crt" \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --service-account-private-key-file "$PKI/sa.key" --requestheader-client-ca-file "$PKI/front-proxy-ca.crt"
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$RUN/scheduler.kubeconfig" \
    --authentication-kubeconfig "$RUN/scheduler.kubeconfig" --authorization-kubeconfig "$RUN/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --leader-elect=false
  containerd_up
  # A kubelet starting on a fresh cluster owns no container: any left by an earlier run (a crash) goes first.
  pid_alive "$RUN/kubelet.pid" || remove_containers
  mkdir -p "$RUN/kubelet/root"
  # Pods resolve cluster names through CoreDNS; its upstream is this file (no search path of the host's).
  grep '^nameserver' /etc/resolv.conf >"$RUN/resolv.conf" 2>/dev/null || echo "nameserver 127.0.0.1" >"$RUN/resolv.conf"
  write_if_changed "$RUN/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: "$PKI/ca.crt"}}
authorization: {mode: Webhook}
clusterDomain: cluster.local
clusterDNS: ["$DNS_SERVICE_IP"]
cgroupDriver: cgroupfs
containerRuntimeEndpoint: "unix://$CONTAINERD_SOCK"
resolvConf: "$RUN/resolv.conf"
failSwapOn: false
address: "$HOST_ADDRESS"
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
maxPods: 60
serializeImagePulls: false
# Images are imported, never pulled: none may be collected, and no disk figure of a shared machine evicts a pod.
# The disk signals are off ("0%"): under disk pressure the kubelet taints the node (new pods stay Pending), evicts
# pods, and reclaims "unused" images first -- the pause image among them (containerd 1.6 does not pin it), after
# which no pod sandbox can be made again (nothing can be pulled here). That stopped KEDA's exec replicas at 1.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "0%", imagefs.available: "0%", nodefs.inodesFree: "0%",
               imagefs.inodesFree: "0%"}
EOF
  start kubelet "$BIN/kubelet" --config "$RUN/kubelet.yaml" --kubeconfig "$RUN/kubelet.kubeconfig" \
    --root-dir "$RUN/kubelet/root" --hostname-override "$NODE_NAME" --node-ip "$HOST_ADDRESS" \
    --node-labels "kiln.dev/sandbox=true,kiln.dev/spare-cpu=true"
  write_if_changed "$RUN/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$RUN/kube-proxy.kubeconfig"}
mode: iptables
clusterCIDR: "$POD_CIDR"
hostnameOverride: $NODE_NAME
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# Host-wide settings stay as they are: no conntrack table size or timeouts, no route_localnet for localhost NodePorts.
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false}
EOF
  start kube-proxy "$BIN/kube-proxy" --config "$RUN/kube-proxy.yaml"
  wait_for "node $NODE_NAME Ready" 180 node_ready
  wait_for "node $NODE_NAME's pod CIDR" 60 node_cidr
  [[ $(kubectl_ get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}') == "$NODE_SUBNET" ]] \
    || die "node $NODE_NAME got pod CIDR $(kubectl_ get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}'), not $NODE_SUBNET"
  missing_images
  addons
  log "cluster up in $((SECONDS - began))s: node $NODE_NAME Ready, CoreDNS, metrics-server and KEDA Available"
  echo "up_s=$((SECONDS - began))"
}

# --- add-ons ------------------------------------------------------------------------------------------------------

addons() {
  sed -e "s|@DNS_SERVICE_IP@|$DNS_SERVICE_IP|" -e "s|@COREDNS_IMAGE@|kiln/k8s-coredns:$COREDNS_VERSION|" \
    "$HERE/coredns.yaml" | kubectl_ apply -f - >/dev/null
  local ms keda
  ms=$(module_source sigs.k8s.io/metrics-server "$METRICS_SERVER_VERSION")/manifests/kiln
  mkdir -p "$ms"
  cat >"$ms/kustomization.yaml" <<EOF
resources: [../base]
images:
- {name: gcr.io/k8s-staging-metrics-server/metrics-server, newName: kiln/k8s-metrics-server, newTag: $METRICS_SERVER_VERSION}
patches:
- target: {kind: Deployment}
  patch: |-
    [{"op": "replace", "path": "/spec/template/spec/containers/0/imagePullPolicy", "value": "Never"},
     {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--kubelet-insecure-tls"}]
EOF
  keda=$(module_source github.com/kedacore/keda/v2 "$KEDA_VERSION")/config/kiln
  mkdir -p "$keda"
  # KEDA's "minimal" set (CRDs, RBAC, operator, metrics API server) without its admission webhooks.
  cat >"$keda/kustomization.yaml" <<EOF
resources: [../crd, ../general, ../rbac, ../manager, ../metrics-server, ../service_account]
images:
- {name: ghcr.io/kedacore/keda, newName: kiln/k8s-keda, newTag: $KEDA_VERSION}
- {name: ghcr.io/kedacore/keda-metrics-apiserver, newName: kiln/k8s-keda-adapter, newTag: $KEDA_VERSION}
patches:
- target: {kind: Deployment}
  patch: '[{"op": "replace", "path": "/spec/template/spec/containers/0/imagePullPolicy", "value": "Never"}]'
EOF
  kubectl_ apply -k "$ms" >/dev/null
  kubectl_ apply --server-side --force-conflicts -k "$keda" >/dev/null
  kubectl_ -n kube-system wait --for=condition=Available deploy/coredns deploy/metrics-server --timeout 300s >&2
  kubectl_ -n keda wait --for=condition=Available deploy/keda-operator deploy/keda-metrics-apiserver \
    --timeout 300s >&2
  wait_for "metrics API" 180 kubectl_ top node
  wait_for "external metrics API" 180 kubectl_ get --raw /apis/external.metrics.k8s.io/v1beta1
}

# --- images -------------------------------------------------------------------------------------------------------

worker_tag() {
  # The worker image's inputs: the checkout's tracked files (index and uncommitted changes) but those no image takes
  # (.dockerignore's tests and bench, the docs, infra but the worker's Dockerfile), and this layer's Dockerfile.
  local paths=(. ':!tests' ':!bench' ':!docs' ':!infra' infra/docker/worker.Dockerfile)
  (cd "$INFRA_DIR/.." && git ls-files -s -- "${paths[@]}" && git diff HEAD -- "${paths[@]}" \
    && cat "$HERE/k8s-worker.Dockerfile" tests/fakes/lean_repl.py) | sha256sum | cut -c1-12
}
engine_tag() {
  sha256sum "$HERE/engine-$ENGINE_MODE.Dockerfile" "$HERE/engine-entrypoint.sh" "$INFRA_DIR/lib.sh" \
    "$INFRA_DIR/egress/egress.sh" | sha256sum | cut -c1-12
}

image_refs() {
  printf '%s\n' "pause=kiln/k8s-pause:$K8S_VERSION" "coredns=kiln/k8s-coredns:$COREDNS_VERSION" \
    "metrics-server=kiln/k8s-metrics-server:$METRICS_SERVER_VERSION" "keda=kiln/k8s-keda:$KEDA_VERSION" \
    "keda-adapter=kiln/k8s-keda-adapter:$KEDA_VERSION" "engine=kiln/k8s-engine-$ENGINE_MODE:$(engine_tag)" \
    "worker=kiln/kiln:k8s-$(worker_tag)"
}

in_containerd() { local refs; refs=$'\n'$(ctr_ images ls -q 2>/dev/null)$'\n'; [[ $refs == *$'\n'"docker.io/$1"$'\n'* ]]; }

# import REF: the image from the Docker engine into the cluster's containerd.
import_image() {
  "$DOCKER" save "$1" | ctr_ images import - >/dev/null
  in_containerd "$1" || die "importing $1 into containerd failed"
}

# binary_image REF BINARY USER: FROM scratch, the one static binary as /NAME, its entrypoint.
binary_image() {
  local ref=$1 name=$2 user=$3 ctx
  ctx=$(mktemp -d "$KILN_CACHE/k8s-image.XXXX")
  cp "$BIN/$name" "$ctx/$name"
  printf 'FROM scratch\nCOPY %s /%s\nUSER %s\nENTRYPOINT ["/%s"]\n' "$name" "$name" "$user" "$name" >"$ctx/Dockerfile"
  "$DOCKER" build -q -t "$ref" "$ctx" >/dev/null
  rm -rf "$ctx"
}

build_image() {
  local what=$1 ref=$2
  case $what in
    pause) binary_image "$ref" pause 65535 ;;
    coredns|metrics-server|keda|keda-adapter) binary_image "$ref" "$what" 65534 ;;
    engine)
      "$DOCKER" image inspect kiln/base:latest >/dev/null 2>&1 || "$INFRA_DIR/docker/docker.sh" base >/dev/null
      local ctx; ctx=$(mktemp -d "$KILN_CACHE/k8s-engine.XXXX")
      cp "$HERE/engine-$ENGINE_MODE.Dockerfile" "$ctx/Dockerfile" && cp "$HERE/engine-entrypoint.sh" "$ctx/"
      cp "$INFRA_DIR/lib.sh" "$INFRA_DIR/egress/egress.sh" "$ctx/"  # the rootful engine runs kiln's egress proxy
      "$DOCKER" build --network host --build-arg BASE_IMAGE=kiln/base:latest -t "$ref" "$ctx" >"$ctx.log" 2>&1 \
        || { tail -30 "$ctx.log" >&2; rm -rf "$ctx"; die "building $ref failed"; }
      rm -rf "$ctx" "$ctx.log" ;;
    worker)
      "$DOCKER" image inspect kiln/base:latest kiln/toolchain:latest >/dev/null 2>&1 \
        || "$INFRA_DIR/docker/docker.sh" images >/dev/null
      local log="$KILN_CACHE/k8s-worker-build.log" root="$INFRA_DIR/.."
      "$DOCKER" build --network host --build-arg BASE_IMAGE=kiln/base:latest \
        --build-arg TOOLCHAIN_IMAGE=kiln/toolchain:latest -f "$root/infra/docker/worker.Dockerfile" \
        -t "kiln/worker:k8s-base" "$root" >"$log" 2>&1 || { tail -30 "$log" >&2; die "building the worker image failed"; }
      local ctx; ctx=$(mktemp -d "$KILN_CACHE/k8s-worker.XXXX")
      cp "$HERE/k8s-worker.Dockerfile" "$ctx/Dockerfile" && cp "$root/tests/fakes/lean_repl.py" "$ctx/"
      "$DOCKER" build --network host --build-arg BASE_IMAGE=kiln/worker:k8s-base -t "$ref" "$ctx" >>"$log" 2>&1 \
        || { tail -30 "$log" >&2; rm -rf "$ctx"; die "building $ref failed"; }
      rm -rf "$ctx" ;;
  esac
}

images() {
  containerd_ready || containerd_up
  local line what ref
  while IFS= read -r line; do
    what=${line%%=*} ref=${line#*=}
    if ! in_containerd "$ref"; then
      "$DOCKER" image inspect "$ref" >/dev/null 2>&1 || { log "building $ref"; build_image "$what" "$ref"; }
      log "importing $ref into the cluster's containerd"
      import_image "$ref"
    fi
    echo "$what=$ref"
  done < <(image_refs)
}

# push LOCAL REMOTE: an image of the Docker engine (imported into containerd if it is not there) pushed to a plain-HTTP
# registry (KILN_K8S_PUSH_USER / _PASSWORD), e.g. the session image exec pods' engines pull: the engine of this
# machine is not told to trust that registry, containerd's client needs no such setting.
# An image containerd lacks is imported for the push alone: not unpacked, its blobs compressed, and removed again
# afterwards (the toolchain image is GBs; a full disk has the kubelet collect the cluster's own images).
push() {
  local local_ref=$1 remote=$2 imported=0
  containerd_ready || containerd_up
  if ! in_containerd "$local_ref"; then
    "$DOCKER" save "$local_ref" | ctr_ images import --no-unpack --compress-blobs - >/dev/null
    imported=1
  fi
  ctr_ images tag --force "docker.io/$local_ref" "$remote" >/dev/null
  ctr_ images push --plain-http ${KILN_K8S_PUSH_USER:+--user "$KILN_K8S_PUSH_USER:${KILN_K8S_PUSH_PASSWORD:-}"} \
    "$remote" >/dev/null
  ctr_ images rm "$remote" >/dev/null
  if ((imported)); then ctr_ images rm --sync "docker.io/$local_ref" >/dev/null; fi
  log "pushed $local_ref as $remote"
}

# missing_images: the add-ons' images (kiln's own are the render's to name) must be in containerd before `up` applies.
missing_images() {
  local ref missing=()
  for ref in "kiln/k8s-pause:$K8S_VERSION" "kiln/k8s-coredns:$COREDNS_VERSION" \
             "kiln/k8s-metrics-server:$METRICS_SERVER_VERSION" "kiln/k8s-keda:$KEDA_VERSION" \
             "kiln/k8s-keda-adapter:$KEDA_VERSION"; do
    in_containerd "$ref" || missing+=("$ref")
  done
  ((${#missing[@]} == 0)) || die "images not in the cluster's containerd: ${missing[*]} (run '$0 images')"
}

# remove_containers: every task killed and every container of the cluster's containerd removed (images kept).
remove_containers() {
  local id
  for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
  sleep 1
  for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$id" >/dev/null 2>&1 || true; done
  for id in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$id" >/dev/null 2>&1 || true; done
}

# --- down / status ------------------------------------------------------------------------------------------------

down() {
  if pid_alive "$RUN/kube-apiserver.pid" && pid_alive "$RUN/kubelet.pid" && api_ready; then
    # No controller may replace a pod; the kubelet then stops each one, and its sandbox's network goes with it.
    stop_pidfile "$RUN/kube-controller-manager.pid" kube-controller-manager
    stop_pidfile "$RUN/kube-scheduler.pid" kube-scheduler
    kubectl_ delete pods --all --all-namespaces --force --grace-period=0 --wait=false >/dev/null 2>&1 || true
    local deadline=$((SECONDS + 90))
    until [[ -z $(ctr_ tasks ls -q 2>/dev/null) ]] || ((SECONDS > deadline)); do sleep 1; done
  fi
  local name
  for name in kube-controller-manager kube-scheduler kubelet kube-proxy; do stop_pidfile "$RUN/$name.pid" "$name"; done
  [[ -x $BIN/kube-proxy ]] && "$BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
  containerd_ready && remove_containers
  stop_pidfile "$RUN/containerd.pid" containerd
  stop_pidfile "$RUN/kube-apiserver.pid" kube-apiserver
  stop_pidfile "$RUN/etcd.pid" etcd
  # Network namespaces of pods the kubelet did not stop: those linked to this cluster's bridge.
  local ns
  for ns in $(ip -o link show master "$BRIDGE" 2>/dev/null | grep -o 'link-netns [^ ]*' | cut -d' ' -f2); do
    ip netns delete "$ns" 2>/dev/null || true
  done
  rm -rf "/var/lib/cni/networks/$CNI_NETWORK"
  # Mounts left under the cluster's directories (secret volumes, sandbox /dev/shm), deepest first, then its state.
  local mount
  while IFS= read -r mount; do umount -l "$mount" 2>/dev/null || true; done \
    < <(findmnt -rn -o TARGET | grep -E "^($RUN/|$CONTAINERD_STATE/)" | sort -r)
  rm -rf --one-file-system "$RUN/etcd" "$RUN/kubelet" "$CONTAINERD_STATE"
  rm -rf /var/log/pods/{kiln,keda,kube-system}_* /var/log/containers/*_{kiln,keda,kube-system}_*  # the kubelet's logs
  ip link delete "$BRIDGE" 2>/dev/null || true
  log "cluster down (binaries, images and certificates kept)"
}

status() {
  local name down=0
  for name in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy; do
    if pid_alive "$RUN/$name.pid"; then echo "$name running (pid $(cat "$RUN/$name.pid"))"
    else echo "$name not running"; down=1; fi
  done
  if api_ready; then kubectl_ get nodes -o wide; kubectl_ get deploy -A; fi
  return "$down"
}

print_env() {
  printf 'KUBECONFIG=%s\nKILN_K8S_HOST_ADDRESS=%s\nKILN_K8S_POD_CIDR=%s\nKILN_K8S_SERVICE_CIDR=%s\nKILN_K8S_BIN=%s\n' \
    "$KUBECONFIG_FILE" "$HOST_ADDRESS" "$POD_CIDR" "$SERVICE_CIDR" "$BIN"
}

case "${1:-}" in
  install) install ;;
  images) images ;;
  control-plane) control_plane ;;
  up) up ;;
  down) down ;;
  status) status ;;
  kubectl) shift; kubectl_ "$@" ;;
  refs) image_refs ;;
  push) [[ $# == 3 ]] || die "usage: $0 push LOCAL_REF REMOTE_REF"; push "$2" "$3" ;;
  env) print_env ;;
  versions) versions ;;
  *) echo "usage: $0 install|versions|images|refs|control-plane|up|down|status|kubectl ARGS…|push LOCAL REMOTE|env" >&2; exit 2 ;;
esac
