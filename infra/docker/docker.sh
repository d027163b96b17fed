#!/usr/bin/env bash
# Docker engine and kiln's local images, built without any registry hub.
#   docker.sh engine      install Debian's docker.io if missing; start dockerd --bridge=none --iptables=false
#                         --no-new-privileges (restarting one this script started without it)
#   docker.sh base        kiln/base:<hash>       debootstrap bookworm minbase (+python3, git, tini) -> docker import
#   docker.sh toolchain   kiln/toolchain:<hash>  base + build tools + the host's Go, Rust, Python and Node toolchains
#   docker.sh images      base and toolchain; prints "name=tag" lines
#   docker.sh status      engine version and kiln images
#   docker.sh stop        stop the dockerd this script started
# Images are tagged by a hash of their inputs and also as :latest, so a warm machine rebuilds nothing.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

DOCKER_RUN="$KILN_RUN/dockerd"
PIDFILE="$DOCKER_RUN/dockerd.pid"
BASE_PACKAGES="ca-certificates,python3,python3-venv,python3-pip,git,tini,procps"
SUITE=bookworm
MIRROR="${KILN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# The Debian client, not a newer one that may sit earlier on PATH, so client and engine agree on the API.
DOCKER="${KILN_DOCKER_CLI:-$(command -v /usr/bin/docker || command -v docker)}"

engine_ready() { "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; }

engine() {
  if engine_ready; then
    # `docker info` does not list the flag: read it from the command line of the dockerd this script started.
    pid_alive "$PIDFILE" || return 0
    if tr '\0' ' ' <"/proc/$(cat "$PIDFILE")/cmdline" | grep -q -- --no-new-privileges; then return 0; fi
    log "restarting dockerd: it was started without --no-new-privileges"
    stop_pidfile "$PIDFILE" dockerd
  fi
  command -v dockerd >/dev/null || apt_install docker.io
  DOCKER="${KILN_DOCKER_CLI:-$(command -v /usr/bin/docker || command -v docker)}"
  mkdir -p "$DOCKER_RUN"
  # --bridge=none: containers get no network unless they ask for the host's; no iptables in this sandbox.
  # --no-new-privileges: every container's default, so a repository Dockerfile's own RUN steps (the build API takes
  # no security options) cannot gain privileges through a setuid program either.
  log "starting dockerd (--bridge=none --iptables=false --no-new-privileges)"
  nohup dockerd --bridge=none --iptables=false --no-new-privileges >"$DOCKER_RUN/dockerd.log" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  wait_for dockerd 60 engine_ready
  log "dockerd ready: $("$DOCKER" version --format '{{.Server.Version}}')"
}

image_exists() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# Bump BASE_RECIPE when the rootfs recipe below changes; the tag hashes it with the suite and packages.
BASE_RECIPE=1
# Local CAs of the host (e.g. a TLS-intercepting egress proxy) are trusted in the image too, so builds that
# reach package registries through host networking work wherever the host's own tools do.
LOCAL_CAS=/usr/local/share/ca-certificates
local_cas_hash() { cat "$LOCAL_CAS"/*.crt 2>/dev/null | sha256sum | cut -c1-12; }
base_tag() { printf '%s %s %s %s' "$SUITE" "$BASE_PACKAGES" "$BASE_RECIPE" "$(local_cas_hash)" | sha256sum | cut -c1-12; }

base() {
  engine
  local tag; tag="kiln/base:$(base_tag)"
  if image_exists "$tag"; then echo "base=$tag"; return 0; fi
  apt_install debootstrap
  local tarball="$KILN_CACHE/rootfs-base-$(base_tag).tar"
  if [[ ! -f $tarball ]]; then
    local root; root=$(mktemp -d "$KILN_CACHE/debootstrap.XXXX")
    log "debootstrap $SUITE minbase + $BASE_PACKAGES (a few minutes, once)"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
      || { tail -20 "$root.log" >&2; rm -rf "$root"; die "debootstrap failed"; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    # An unprivileged user for sandboxed work; uid 1000 matches what the exec stage expects.
    chroot "$root" useradd --uid 1000 --create-home --shell /bin/bash kiln
    if compgen -G "$LOCAL_CAS/*.crt" >/dev/null; then
      cp "$LOCAL_CAS"/*.crt "$root/usr/local/share/ca-certificates/"
      chroot "$root" update-ca-certificates >/dev/null
    fi
    tar -C "$root" --numeric-owner -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    rm -rf "$root" "$root.log"
  fi
  "$DOCKER" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tarball" "$tag" >/dev/null
  "$DOCKER" tag "$tag" kiln/base:latest
  log "built $tag"
  echo "base=$tag"
}

toolchain_inputs() {
  printf '%s\n' "$(base_tag)" "$(sha256sum "$INFRA_DIR/docker/toolchain.Dockerfile" | cut -c1-12)" \
    "$(go version 2>/dev/null)" "$(rustc --version 2>/dev/null)" "$(python3 --version 2>&1)" "$(node --version 2>/dev/null)"
}

toolchain() {
  base >/dev/null
  local tag; tag="kiln/toolchain:$(toolchain_inputs | sha256sum | cut -c1-12)"
  if image_exists "$tag"; then echo "toolchain=$tag"; return 0; fi
  local ctx; ctx=$(mktemp -d "$KILN_CACHE/toolchain-ctx.XXXX")
  log "assembling toolchain context (host Go, Rust, Python, Node)"
  cp -a "$(go env GOROOT)" "$ctx/go"
  local sysroot; sysroot=$(rustc --print sysroot)
  cp -a "$sysroot" "$ctx/rust"
  rm -rf "$ctx/rust/share/doc" "$ctx/rust/share/man"
  local pyprefix; pyprefix=$(python3 -c 'import sys; print(sys.base_prefix)')
  cp -a "$pyprefix" "$ctx/python"
  mkdir -p "$ctx/node/bin" "$ctx/node/lib/node_modules"
  cp -a "$(command -v node)" "$ctx/node/bin/node"
  cp -a "$(npm root -g)/npm" "$ctx/node/lib/node_modules/npm"
  ln -s ../lib/node_modules/npm/bin/npm-cli.js "$ctx/node/bin/npm"
  ln -s ../lib/node_modules/npm/bin/npx-cli.js "$ctx/node/bin/npx"
  cp "$INFRA_DIR/docker/toolchain.Dockerfile" "$ctx/Dockerfile"
  log "building $tag"
  "$DOCKER" build --network host --build-arg "BASE_IMAGE=kiln/base:$(base_tag)" -t "$tag" "$ctx" >"$ctx.log" 2>&1 \
    || { tail -30 "$ctx.log" >&2; rm -rf "$ctx"; die "toolchain build failed"; }
  rm -rf "$ctx" "$ctx.log"
  "$DOCKER" tag "$tag" kiln/toolchain:latest
  log "built $tag"
  echo "toolchain=$tag"
}

status() {
  engine_ready || { echo "dockerd not running"; return 1; }
  echo "dockerd $("$DOCKER" version --format '{{.Server.Version}}') running; images:"
  "$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^kiln/' | sed 's/^/  /' || true
}

case "${1:-}" in
  engine) engine ;;
  base) base ;;
  toolchain) toolchain ;;
  images) base; toolchain ;;
  stop) stop_pidfile "$PIDFILE" dockerd ;;
  status) status ;;
  *) echo "usage: $0 engine|base|toolchain|images|status|stop" >&2; exit 2 ;;
esac
