#!/usr/bin/env bash
# The egress boundary for builds: a kiln-owned Docker network whose only reachable address is a forward proxy
# (Debian's tinyproxy) that lets CONNECT/GET through to an allowlist of package registries and nothing else.
#   egress.sh start | stop | status | env
#   egress.sh serve     in a container on the host's network (the compose stack's `egress` service): the network
#                       exists already (made by compose), the rules are installed, tinyproxy runs in the foreground,
#                       and the rules are removed again when it is stopped
#   egress.sh ready     exit 0 when the proxy answers on the gateway (the service's health check)
#   egress.sh check     from a container on the egress network (a build step's view): the proxy answers, refuses a
#                       host outside its allowlist, and no other port of the gateway, nor any other address, answers
# Enforced by the host's packet filter (dockerd runs with --iptables=false, so kiln writes its own rules):
#   - from the bridge, only tcp to <gateway>:<port> (the proxy) is accepted; everything else is rejected, and
#     nothing is forwarded off the bridge (no route to the internet, other hosts or private ranges);
#   - nothing passes between two containers on the bridge: IP is rejected in FORWARD (the kernel hands bridged IP
#     to iptables: bridge-nf-call-iptables), and any frame (ARP included) a container sends to another port is
#     dropped by ebtables (source MACs of the subnet: Docker derives a container's MAC from its address; changing
#     it needs NET_ADMIN, which no build step has);
#   - no resolver: only the proxy's port on the gateway is open, so DNS (Docker's embedded resolver forwards from
#     the container's own namespace) reaches nothing; names are resolved by the proxy;
#   - the proxy runs as its own user, and that user's connections to loopback, link-local and private ranges are
#     rejected (the resolver excepted), so an allowed name that resolves inward still goes nowhere.
# Env: KILN_EGRESS_NETWORK (kiln-egress), KILN_EGRESS_SUBNET (172.31.250.0/24), KILN_EGRESS_PORT (3128),
#      KILN_EGRESS_CHAIN (KILN-EGRESS: the iptables chains' name),
#      KILN_EGRESS_ALLOW (space-separated host names; suffix match; default: the package registries below),
#      KILN_EGRESS_ALLOW_EXTRA (hosts added to that list, e.g. storage.googleapis.com, where proxy.golang.org
#      redirects module zips: a generic storage host anyone can put a bucket on, so never a default).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

NETWORK="${KILN_EGRESS_NETWORK:-kiln-egress}"
SUBNET="${KILN_EGRESS_SUBNET:-172.31.250.0/24}"
PORT="${KILN_EGRESS_PORT:-3128}"
BRIDGE="${NETWORK:0:12}0"
GATEWAY="${SUBNET%.*}.1"
# Package registries only: no host that serves anyone's content (object storage, gists, pastebins).
DEFAULT_ALLOW="pypi.org files.pythonhosted.org registry.npmjs.org registry.yarnpkg.com crates.io index.crates.io
static.crates.io proxy.golang.org sum.golang.org repo.maven.apache.org repo1.maven.org deb.debian.org"
ALLOW="${KILN_EGRESS_ALLOW:-$DEFAULT_ALLOW} ${KILN_EGRESS_ALLOW_EXTRA:-}"
# Not under $KILN_RUN: the proxy drops to its own user, which must reach its log and pid files.
DATA="${KILN_EGRESS_DATA:-/var/lib/kiln-egress/$NETWORK}"
PIDFILE="$DATA/tinyproxy.pid"
PROXY_USER=kiln-egress
# One set of chains per egress network: the host's and a compose stack's coexist.
CHAIN="${KILN_EGRESS_CHAIN:-KILN-EGRESS}"
OUT_CHAIN="$CHAIN-OUT"
BUILD_CGROUP="${KILN_BUILD_CGROUP:-kiln-builds}"
BUILD_PIDS="${KILN_BUILD_CGROUP_PIDS:-8192}"
INWARD="127.0.0.0/8 10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 169.254.0.0/16 100.64.0.0/10 0.0.0.0/8"

network() {
  DOCKER="$(command -v /usr/bin/docker || command -v docker)"
  if ! "$DOCKER" network inspect "$NETWORK" >/dev/null 2>&1; then
    log "creating docker network $NETWORK ($SUBNET, bridge $BRIDGE)"
    "$DOCKER" network create --driver bridge --subnet "$SUBNET" --gateway "$GATEWAY" \
      -o "com.docker.network.bridge.name=$BRIDGE" -o com.docker.network.bridge.enable_ip_masquerade=false \
      --label kiln.role=egress "$NETWORK" >/dev/null
  fi
}

# Rules are rebuilt from scratch every start: a half-written set from an earlier run never survives.
rules() {
  apt_install iptables
  iptables -N "$CHAIN" 2>/dev/null || iptables -F "$CHAIN"
  iptables -A "$CHAIN" -p tcp -d "$GATEWAY" --dport "$PORT" -j ACCEPT
  iptables -A "$CHAIN" -j REJECT --reject-with icmp-port-unreachable
  iptables -C INPUT -i "$BRIDGE" -j "$CHAIN" 2>/dev/null || iptables -I INPUT 1 -i "$BRIDGE" -j "$CHAIN"
  iptables -C FORWARD -i "$BRIDGE" -j REJECT 2>/dev/null || iptables -I FORWARD 1 -i "$BRIDGE" -j REJECT
  iptables -C FORWARD -o "$BRIDGE" -j REJECT 2>/dev/null || iptables -I FORWARD 1 -o "$BRIDGE" -j REJECT
  layer2
  if command -v ip6tables >/dev/null; then
    ip6tables -C INPUT -i "$BRIDGE" -j REJECT 2>/dev/null || ip6tables -I INPUT 1 -i "$BRIDGE" -j REJECT
    ip6tables -C FORWARD -i "$BRIDGE" -j REJECT 2>/dev/null || ip6tables -I FORWARD 1 -i "$BRIDGE" -j REJECT
  fi
  local uid; uid=$(id -u "$PROXY_USER")
  iptables -N "$OUT_CHAIN" 2>/dev/null || iptables -F "$OUT_CHAIN"
  # Only new connections are checked: the proxy's replies to its clients on the bridge stay allowed.
  iptables -A "$OUT_CHAIN" -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
  local resolver
  for resolver in $(awk '/^nameserver/ && $2 ~ /^[0-9.]+$/ {print $2}' /etc/resolv.conf); do
    iptables -A "$OUT_CHAIN" -d "$resolver" -p udp --dport 53 -j RETURN
    iptables -A "$OUT_CHAIN" -d "$resolver" -p tcp --dport 53 -j RETURN
  done
  local range
  for range in $INWARD; do iptables -A "$OUT_CHAIN" -d "$range" -j REJECT; done
  iptables -C OUTPUT -m owner --uid-owner "$uid" -j "$OUT_CHAIN" 2>/dev/null \
    || iptables -I OUTPUT 1 -m owner --uid-owner "$uid" -j "$OUT_CHAIN"
}

# Container to container below IP: the FORWARD rules above see bridged IP only because the kernel hands it to
# iptables; ARP and other frames are dropped here (frames to the gateway itself take ebtables' INPUT, not FORWARD).
# Fails closed: without these filters the proxy is not started.
layer2() {
  [[ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null)" == 1 ]] \
    || { modprobe br_netfilter 2>/dev/null; sysctl -qw net.bridge.bridge-nf-call-iptables=1 \
         net.bridge.bridge-nf-call-ip6tables=1 >/dev/null 2>&1; } \
    || die "bridged traffic does not pass iptables (br_netfilter): builds could reach each other"
  apt_install ebtables
  local mac
  mac=$(subnet_mac)
  ebtables -C FORWARD -s "$mac" -j DROP 2>/dev/null || ebtables -I FORWARD 1 -s "$mac" -j DROP \
    || die "ebtables FORWARD rule for $mac failed"
}

# 02:42 and the subnet's address bytes, with the mask its prefix length rounds down to in whole bytes.
subnet_mac() {
  local address="${SUBNET%/*}" bits="${SUBNET#*/}" mac="02:42" mask="ff:ff" i=0 byte
  for byte in ${address//./ }; do
    if (( i * 8 < bits / 8 * 8 )); then mac+=$(printf ':%02x' "$byte"); mask+=":ff"
    else mac+=":00"; mask+=":00"; fi
    i=$((i + 1))
  done
  echo "$mac/$mask"
}

config() {
  mkdir -p "$DATA"
  local host
  : >"$DATA/allow.txt"
  # fnmatch patterns: the host itself and its subdomains.
  for host in $ALLOW; do printf '%s\n*.%s\n' "$host" "$host" >>"$DATA/allow.txt"; done
  cat >"$DATA/tinyproxy.conf" <<EOF
User $PROXY_USER
Group nogroup
Listen $GATEWAY
Port $PORT
Timeout 300
MaxClients 200
LogLevel Connect
LogFile "$DATA/tinyproxy.log"
PidFile "$PIDFILE"
Allow $SUBNET
ViaProxyName "kiln-egress"
DisableViaHeader Yes
Filter "$DATA/allow.txt"
FilterType fnmatch
FilterURLs Off
FilterDefaultDeny Yes
ConnectPort 443
ConnectPort 80
EOF
  chown -R "$PROXY_USER" "$DATA"
}

# The parent cgroup of `docker build` steps (KILN_BUILD_CGROUP): the classic builder takes memory and CPU limits
# per build but no pids limit, so a fork bomb in a build step meets this one instead.
build_cgroup() {
  local dir
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then dir="/sys/fs/cgroup/$BUILD_CGROUP"
  else dir="/sys/fs/cgroup/pids/$BUILD_CGROUP"; fi
  mkdir -p "$dir" 2>/dev/null && echo "$BUILD_PIDS" >"$dir/pids.max" 2>/dev/null \
    || log "warning: could not bound pids of $dir (build steps keep their memory/CPU limits)"
}

proxy_ready() { tcp_open "$GATEWAY" "$PORT"; }

# What rules() and layer2() installed, removed (serve's exit: a stopped stack leaves no filter behind).
unrules() {
  iptables -D INPUT -i "$BRIDGE" -j "$CHAIN" 2>/dev/null || true
  iptables -D FORWARD -i "$BRIDGE" -j REJECT 2>/dev/null || true
  iptables -D FORWARD -o "$BRIDGE" -j REJECT 2>/dev/null || true
  iptables -D OUTPUT -m owner --uid-owner "$(id -u "$PROXY_USER")" -j "$OUT_CHAIN" 2>/dev/null || true
  iptables -F "$CHAIN" 2>/dev/null && iptables -X "$CHAIN" 2>/dev/null || true
  iptables -F "$OUT_CHAIN" 2>/dev/null && iptables -X "$OUT_CHAIN" 2>/dev/null || true
  ebtables -D FORWARD -s "$(subnet_mac)" -j DROP 2>/dev/null || true
  if command -v ip6tables >/dev/null; then
    ip6tables -D INPUT -i "$BRIDGE" -j REJECT 2>/dev/null || true
    ip6tables -D FORWARD -i "$BRIDGE" -j REJECT 2>/dev/null || true
  fi
}

bridge_up() { ip -4 addr show dev "$BRIDGE" 2>/dev/null | grep -q "inet $GATEWAY/"; }

serve() {
  id -u "$PROXY_USER" >/dev/null 2>&1 || die "user $PROXY_USER missing (the egress image creates it)"
  wait_for "bridge $BRIDGE with $GATEWAY (network $NETWORK)" 60 bridge_up
  trap unrules EXIT
  rules
  config
  log "serving tinyproxy on $GATEWAY:$PORT for $NETWORK (allow: $(echo $ALLOW | wc -w) registries)"
  tinyproxy -d -c "$DATA/tinyproxy.conf" &
  local pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
  wait "$pid" || true
  wait "$pid" 2>/dev/null || true
}

start() {
  apt_install tinyproxy
  # Debian's package starts its own instance on 8888: kiln runs its own, so that one stays off.
  if command -v systemctl >/dev/null && systemctl is-active --quiet tinyproxy 2>/dev/null; then
    systemctl disable --now tinyproxy >/dev/null 2>&1 || true
  fi
  pkill -u tinyproxy -x tinyproxy 2>/dev/null || true
  id -u "$PROXY_USER" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$PROXY_USER"
  network
  rules
  build_cgroup
  local wanted; wanted=$(printf '%s %s %s' "$(echo $ALLOW)" "$GATEWAY" "$PORT" | sha256sum | cut -c1-12)
  if same_config_running "$PIDFILE" "$DATA/config.key" "$wanted" && proxy_ready; then
    log "egress proxy already running on $GATEWAY:$PORT"; return 0
  fi
  pid_alive "$PIDFILE" && stop_pidfile "$PIDFILE" tinyproxy
  config
  echo "$wanted" >"$DATA/config.key"
  log "starting tinyproxy on $GATEWAY:$PORT (allow: $(echo $ALLOW | wc -w) registries)"
  tinyproxy -c "$DATA/tinyproxy.conf"
  wait_for tinyproxy 20 proxy_ready
  log "egress proxy ready on http://$GATEWAY:$PORT"
}

status() {
  if pid_alive "$PIDFILE" && proxy_ready; then echo "egress proxy running on http://$GATEWAY:$PORT ($NETWORK)"
  else echo "egress proxy not running"; return 1; fi
}

print_env() {
  printf 'KILN_BUILD_NETWORK=%s\nKILN_BUILD_PROXY=http://%s:%s\n' "$NETWORK" "$GATEWAY" "$PORT"
}

# A build step's view of the boundary; exits non-zero (and says what) when anything beside the proxy answers.
check() {
  wait_for "egress proxy on $GATEWAY:$PORT" 60 proxy_ready
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' -x "http://$GATEWAY:$PORT" --max-time 10 http://kiln-check.invalid/ || true)
  [[ $code == 403 ]] || die "the proxy let a host outside its allowlist through (HTTP $code)"
  local port
  for port in 22 80 443 2375 5000 7070 8500 9092 9100 29092; do
    timeout 3 bash -c "exec 3<>/dev/tcp/$GATEWAY/$port" 2>/dev/null && die "port $port of the gateway answers"
  done
  local target
  for target in 1.1.1.1/443 8.8.8.8/53 10.0.0.1/80 192.168.0.1/80; do
    timeout 3 bash -c "exec 3<>/dev/tcp/$target" 2>/dev/null && die "${target%/*} answers from the egress network"
  done
  log "egress boundary checked: only the proxy answers on $NETWORK"
}

case "${1:-}" in
  start) start ;;
  stop) stop_pidfile "$PIDFILE" tinyproxy ;;
  status) status ;;
  env) print_env ;;
  serve) serve ;;
  ready) proxy_ready ;;
  check) check ;;
  *) echo "usage: $0 start|stop|status|env|serve|ready|check" >&2; exit 2 ;;
esac
