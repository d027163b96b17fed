#!/usr/bin/env bash
# Worker nodes on one machine: each node is its own network namespace with its own Docker engine (own containerd,
# data root, bridge and packet filter), its own egress proxy, and the kiln workers started in it. Nodes share only
# what a real cluster's nodes share — the Kafka cluster, S3 and the registry — reached over the nodes' bridge, never
# over loopback.
#   nodes.sh up I        node I: namespace, its link to the bridge, its cgroup, its engine, its egress (idempotent)
#   nodes.sh kill I      node I dies whole, as a preempted VM does: every process of it — workers, dockerd,
#                        containerd, the shims, the sandboxes — frozen and SIGKILLed at once (its disk is kept;
#                        its /run is wiped, as a reboot wipes it). `up I` brings it back.
#   nodes.sh down [I]    stop node I (or every node) and remove its namespace, cgroup and state
#   nodes.sh run I CMD…  run CMD in node I (its network namespace and cgroup, DOCKER_HOST its engine's socket)
#   nodes.sh env I       what a process of node I is given (DOCKER_HOST, KILN_NODE_*), as shell assignments
#   nodes.sh address     the host's address on the bridge: where a node reaches Kafka, S3 and the registry
#   nodes.sh bridge      make that bridge (before a service listens on its address), with the host's rules for it
#   nodes.sh pids I      the pids of node I's processes (its cgroup's)
#   nodes.sh status      each node's state
# Env: KILN_NODES_SUBNET (10.231.0: a /24; the host is .1, node I is .(10+I)), KILN_NODES_INSECURE_REGISTRY
#      (host:port of the registry the engines pull from over plain HTTP; default: none), KILN_NODES_DATA
#      ($KILN_RUN/nodes: the nodes' disks, kept across runs so a node's pulled images stay, as a VM's disk does).
# A node's egress rules (its own packet filter, in its namespace): its build steps reach only the node's own egress
# proxy (infra/egress/egress.sh, started in the node: the kiln-egress network of the node's engine, tinyproxy on its
# gateway, in the node's cgroup); its other sandboxes have no network at all (the sandbox policy). Out of the node
# go only its processes' connections to the host's address (the shared Kafka, S3 and registry) and the proxy's to
# the registries it allows — never to the host or another node (KILN-NODE, in the node's OUTPUT). The host
# masquerades the nodes' subnet for that upstream alone: what the bridge forwards may not reach private ranges
# (KILN-NODES, in the host's FORWARD), the resolver excepted.
# A node's processes keep the host's mount namespace (nsenter --net, not `ip netns exec`, which makes a mount
# namespace per command): the exec reaper judges containers by the mount namespace their worker's lock is in.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

SUBNET="${KILN_NODES_SUBNET:-10.231.0}"
HOST_ADDRESS="$SUBNET.1"
BRIDGE=kiln-nodes
DATA_ROOT="${KILN_NODES_DATA:-$KILN_RUN/nodes}"
RUN_ROOT=/run/kiln-nodes
EGRESS_SH="$INFRA_DIR/egress/egress.sh"
PROXY_USER=kiln-egress  # the user egress.sh's tinyproxy runs as
NODE_CHAIN=KILN-NODE
HOST_CHAIN=KILN-NODES
INWARD="127.0.0.0/8 10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 169.254.0.0/16 100.64.0.0/10 0.0.0.0/8"
# The controllers whose hierarchy holds a node's processes: freezer (a node stops at once) and pids (they are
# listed); the engine puts its containers under the same parent in every controller (--cgroup-parent).
CGROUP_FS=/sys/fs/cgroup

use_node() {
  [[ ${1:-} =~ ^[1-9]$ ]] || die "a node is 1-9, not '${1:-}'"
  NODE=$1
  NS="kiln-node-$NODE"
  ADDRESS="$SUBNET.$((10 + NODE))"
  DATA="$DATA_ROOT/n$NODE"
  RUN="$RUN_ROOT/n$NODE"
  SOCK="$RUN/docker.sock"
  CGROUP="kiln-node-$NODE"
}

bridge() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  # (grep on a captured listing: `ip … | grep -q` fails under pipefail when grep stops reading early)
  [[ $(ip addr show dev "$BRIDGE") == *"inet $HOST_ADDRESS/"* ]] || ip addr add "$HOST_ADDRESS/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  host_rules
}

# The host's side: the nodes' subnet masqueraded when it leaves by another interface (the proxies' upstream), and
# nothing forwarded from the bridge to a private range but the resolver (rebuilt from scratch each time, under a
# lock: nodes come up side by side).
host_rules() {
  apt_install iptables
  exec 8>"$KILN_RUN/nodes-host-rules.lock"
  flock 8
  iptables -t nat -C POSTROUTING -s "$SUBNET.0/24" ! -o "$BRIDGE" -j MASQUERADE 2>/dev/null \
    || iptables -t nat -A POSTROUTING -s "$SUBNET.0/24" ! -o "$BRIDGE" -j MASQUERADE
  iptables -N "$HOST_CHAIN" 2>/dev/null || iptables -F "$HOST_CHAIN"
  iptables -A "$HOST_CHAIN" -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
  local resolver range
  for resolver in $(resolvers); do
    iptables -A "$HOST_CHAIN" -d "$resolver" -p udp --dport 53 -j RETURN
    iptables -A "$HOST_CHAIN" -d "$resolver" -p tcp --dport 53 -j RETURN
  done
  for range in $INWARD; do iptables -A "$HOST_CHAIN" -d "$range" -j REJECT; done
  iptables -C FORWARD -i "$BRIDGE" -j "$HOST_CHAIN" 2>/dev/null || iptables -I FORWARD 1 -i "$BRIDGE" -j "$HOST_CHAIN"
  exec 8>&-
}

unhost_rules() {
  iptables -t nat -D POSTROUTING -s "$SUBNET.0/24" ! -o "$BRIDGE" -j MASQUERADE 2>/dev/null || true
  iptables -D FORWARD -i "$BRIDGE" -j "$HOST_CHAIN" 2>/dev/null || true
  iptables -F "$HOST_CHAIN" 2>/dev/null && iptables -X "$HOST_CHAIN" 2>/dev/null || true
}

resolvers() { awk '/^nameserver/ && $2 ~ /^[0-9.]+$/ {print $2}' /etc/resolv.conf; }

namespace() {
  bridge
  [[ -e /run/netns/$NS ]] || ip netns add "$NS"
  local host_end="kn$NODE-h"
  if ! ip link show "$host_end" >/dev/null 2>&1; then
    ip link add "$host_end" type veth peer name "kn$NODE-n"
    ip link set "kn$NODE-n" netns "$NS"
    ip -n "$NS" link set "kn$NODE-n" name eth0
  fi
  ip link set "$host_end" master "$BRIDGE" up
  ip -n "$NS" link set lo up
  ip -n "$NS" link set eth0 up
  [[ $(ip -n "$NS" addr show dev eth0) == *"inet $ADDRESS/"* ]] || ip -n "$NS" addr add "$ADDRESS/24" dev eth0
  ip -n "$NS" route replace default via "$HOST_ADDRESS"
}

controllers() { echo freezer pids; }

cgroups() {
  local c
  for c in $(controllers); do mkdir -p "$CGROUP_FS/$c/$CGROUP/system"; done
}

# join: this shell (and what it execs) into node I's cgroups.
join() {
  local c
  for c in $(controllers); do echo "$BASHPID" >"$CGROUP_FS/$c/$CGROUP/system/cgroup.procs"; done
}

engine_ready() { DOCKER_HOST="unix://$SOCK" docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

engine() {
  if engine_ready; then return 0; fi
  mkdir -p "$DATA/docker" "$DATA/kiln" "$RUN"
  echo '{}' >"$RUN/daemon.json"
  local insecure=()
  [[ -n ${KILN_NODES_INSECURE_REGISTRY:-} ]] && insecure=(--insecure-registry "$KILN_NODES_INSECURE_REGISTRY")
  log "starting node $NODE's dockerd in $NS ($ADDRESS)"
  # No system containerd here: dockerd starts its own under --exec-root, so each node has its own containerd
  # and shims, and a node's death takes them with it. --bridge=none as on the host; --iptables=false: the
  # node's egress rules are kiln's own (infra/egress/egress.sh, run in the node).
  (join; exec nsenter --net="/run/netns/$NS" nohup dockerd --config-file "$RUN/daemon.json" \
    --data-root "$DATA/docker" --exec-root "$RUN/docker" --pidfile "$RUN/dockerd.pid" -H "unix://$SOCK" \
    --bridge=none --iptables=false --ip-masq=false --no-new-privileges --userland-proxy=false \
    --cgroup-parent "$CGROUP" "${insecure[@]}" >"$DATA/dockerd.log" 2>&1 </dev/null) &
  wait_for "node $NODE's dockerd" 60 engine_ready
}

# in_node CMD…: CMD in node I's network namespace and cgroup (what it starts stays in them).
in_node() { (join; exec nsenter --net="/run/netns/$NS" "$@"); }

# The node's egress proxy (egress.sh start, in the node: its engine's kiln-egress network, the rules in the node's
# namespace, tinyproxy in the node's cgroup, its files on the node's /run), then the node's own OUTPUT rules.
egress() {
  mkdir -p "$RUN"
  in_node env DOCKER_HOST="unix://$SOCK" KILN_EGRESS_DATA="$RUN/egress" KILN_BUILD_CGROUP="$CGROUP/builds" \
    bash "$EGRESS_SH" start >>"$DATA/egress.log" 2>&1 || die "node $NODE's egress proxy: $(tail -5 "$DATA/egress.log")"
  node_rules
}

# KILN-NODE: what may leave the node's namespace (rebuilt from scratch each time). Its own loopback and bridges
# (the proxy answering its build steps); to the host's address, anything but the proxy; the proxy anywhere but the
# nodes' subnet and the host's own addresses (egress.sh's own chain, before this one, keeps it from every private
# range but the resolver); nothing else — the node's workers reach the internet only as the proxy does, for a build
# step.
node_rules() {
  local proxy_uid host_address refuse=""
  proxy_uid=$(id -u "$PROXY_USER")
  for host_address in $(ip -4 -o addr show | awk '{split($4, a, "/"); print a[1]}'); do
    refuse+="iptables -A $NODE_CHAIN -m owner --uid-owner $proxy_uid -d $host_address -j REJECT;"
  done
  nsenter --net="/run/netns/$NS" bash -euo pipefail -c "
    iptables -N $NODE_CHAIN 2>/dev/null || iptables -F $NODE_CHAIN
    iptables -A $NODE_CHAIN -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    iptables -A $NODE_CHAIN ! -o eth0 -j ACCEPT
    iptables -A $NODE_CHAIN -m owner --uid-owner $proxy_uid -d $SUBNET.0/24 -j REJECT
    $refuse
    iptables -A $NODE_CHAIN -m owner --uid-owner $proxy_uid -j ACCEPT
    iptables -A $NODE_CHAIN -d $HOST_ADDRESS -j ACCEPT
    iptables -A $NODE_CHAIN -j REJECT
    iptables -C OUTPUT -j $NODE_CHAIN 2>/dev/null || iptables -A OUTPUT -j $NODE_CHAIN
    if command -v ip6tables >/dev/null; then
      ip6tables -C OUTPUT -o eth0 -j REJECT 2>/dev/null || ip6tables -A OUTPUT -o eth0 -j REJECT
    fi"
}

up() {
  use_node "$1"
  namespace
  cgroups
  engine
  egress
  log "node $NODE up: $NS at $ADDRESS, engine unix://$SOCK, egress proxy on its kiln-egress network"
}

node_env() {
  use_node "$1"
  printf 'DOCKER_HOST=unix://%s\nKILN_NODE=%s\nKILN_NODE_ADDRESS=%s\nKILN_NODE_HOST_ADDRESS=%s\n' \
    "$SOCK" "$NODE" "$ADDRESS" "$HOST_ADDRESS"
  # The exec workers' liveness locks and label seal live on the node's disk: a worker of the node after its
  # restart reaps what the dead ones left. Its caches (Saucer's, the builder's work) are the node's own too.
  printf 'KILN_EXEC_LOCK_DIR=%s\nKILN_EXEC_SEAL_DIR=%s\nKILN_CACHE=%s\n' "$DATA/kiln/exec" "$DATA/kiln" "$DATA/kiln/cache"
  # The builders' liveness locks likewise; their build steps run in the node's cgroup (bounded and killed with it)
  # and go out through the node's own egress proxy (egress.sh's defaults, on the node's engine).
  printf 'KILN_BUILD_LOCK_DIR=%s\nKILN_BUILD_CGROUP=%s\n' "$DATA/kiln/build" "$CGROUP/builds"
}

run() {
  use_node "$1"; shift
  [[ -e /run/netns/$NS ]] || die "node $NODE is not up"
  join
  local line
  while IFS= read -r line; do export "${line?}"; done < <(node_env "$NODE")
  exec nsenter --net="/run/netns/$NS" "$@"
}

node_pids() {
  use_node "$1"
  local dir
  [[ -d $CGROUP_FS/pids/$CGROUP ]] || return 0
  while IFS= read -r dir; do cat "$dir/cgroup.procs"; done < <(find "$CGROUP_FS/pids/$CGROUP" -type d)
}

freezer_state() { cat "$CGROUP_FS/freezer/$CGROUP/freezer.state" 2>/dev/null || echo THAWED; }

# unmount_under DIR: the mounts a killed engine left under DIR (overlays, shm, netns files), deepest first.
unmount_under() {
  local m
  awk -v d="$1" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/mounts | sort -r | while IFS= read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
}

kill_node() {
  use_node "$1"
  [[ -d $CGROUP_FS/freezer/$CGROUP ]] || { log "node $NODE has no processes"; return 0; }
  # Frozen first, so nothing of the node acts (restarts a child, reaps, writes) between two kills.
  echo FROZEN >"$CGROUP_FS/freezer/$CGROUP/freezer.state"
  local waited=0
  until [[ $(freezer_state) == FROZEN ]] || ((waited >= 50)); do sleep 0.1; waited=$((waited + 1)); done
  local pids; pids=$(node_pids "$NODE" | tr '\n' ' ')
  [[ -n ${pids// /} ]] && kill -9 $pids 2>/dev/null || true
  echo THAWED >"$CGROUP_FS/freezer/$CGROUP/freezer.state"
  local tries=0
  while [[ -n $(node_pids "$NODE") ]] && ((tries < 100)); do
    pids=$(node_pids "$NODE" | tr '\n' ' ')
    kill -9 $pids 2>/dev/null || true
    sleep 0.1; tries=$((tries + 1))
  done
  [[ -z $(node_pids "$NODE") ]] || die "node $NODE: processes survived: $(node_pids "$NODE" | tr '\n' ' ')"
  unmount_under "$RUN"
  unmount_under "$DATA/docker"
  rm -rf "$RUN"  # a reboot wipes /run; the disk ($DATA) stays
  log "node $NODE killed: its processes, engine, shims and sandboxes are gone"
}

down() {
  use_node "$1"
  if engine_ready; then
    kill "$(cat "$RUN/dockerd.pid" 2>/dev/null)" 2>/dev/null || true
    wait_for "node $NODE's dockerd to stop" 30 bash -c "! kill -0 $(cat "$RUN/dockerd.pid" 2>/dev/null || echo 0)"
  fi
  kill_node "$NODE" >/dev/null 2>&1 || true
  local c
  for c in $(controllers); do
    find "$CGROUP_FS/$c/$CGROUP" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  ip link del "kn$NODE-h" 2>/dev/null || true
  ip netns del "$NS" 2>/dev/null || true
  log "node $NODE down"
}

status() {
  local i any=0
  for i in 1 2 3 4 5 6 7 8 9; do
    use_node "$i"
    [[ -e /run/netns/$NS ]] || continue
    any=1
    if engine_ready; then echo "node $i: up ($ADDRESS, $(node_pids "$i" | wc -l) processes)"
    else echo "node $i: engine down ($ADDRESS)"; fi
  done
  ((any)) || echo "no nodes"
}

case "${1:-}" in
  up) up "${2:-}" ;;
  kill) kill_node "${2:-}" ;;
  down)
    if [[ -n ${2:-} ]]; then down "$2"
    else
      for n in /run/netns/kiln-node-*; do [[ -e $n ]] && down "${n##*-}"; done
      unhost_rules
    fi ;;
  run) n="${2:-}"; shift 2 || true; run "$n" "$@" ;;
  env) node_env "${2:-}" ;;
  address) echo "$HOST_ADDRESS" ;;
  bridge) bridge ;;
  pids) node_pids "${2:-}" ;;
  status) status ;;
  *) echo "usage: $0 up|kill|down|run|env|address|bridge|pids|status [node] [cmd...]" >&2; exit 2 ;;
esac
