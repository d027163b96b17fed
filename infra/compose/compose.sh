#!/usr/bin/env bash
# Docker Compose v2 and the stack's images for machines without a hub, built from the registries kiln reaches.
#   compose.sh install   Docker Compose v2 from its Go module ($KILN_CACHE/compose-<version>), installed as the
#                        docker CLI plugin (`docker compose`) in ${DOCKER_CONFIG:-~/.docker}/cli-plugins
#   compose.sh images    the local equivalents of the hub images docker-compose.yml names (infra/compose/no-hub.yml
#                        points the stack at them): kiln/stack-kafka (Apache Kafka from Maven Central's jars, in
#                        place of Redpanda), kiln/stack-s3 (versitygw from its Go module), kiln/stack-registry and
#                        kiln/stack-prometheus (Debian's docker-registry and prometheus), each FROM kiln/base
#   compose.sh status    compose version and the stack images
# Images are tagged by a hash of their inputs and as :local (what no-hub.yml names), so a warm machine rebuilds nothing.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

COMPOSE_VERSION=v2.32.4
COMPOSE_BIN="$KILN_CACHE/compose-$COMPOSE_VERSION/bin/cmd"
PLUGIN_DIR="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
DOCKER="${KILN_DOCKER_CLI:-$(command -v /usr/bin/docker || command -v docker)}"
HERE="$INFRA_DIR/compose"

install() {
  if [[ ! -x $COMPOSE_BIN ]]; then
    log "building Docker Compose $COMPOSE_VERSION from its Go module (a few minutes, once)"
    GOBIN="$(dirname "$COMPOSE_BIN")" GOFLAGS=-trimpath go install "github.com/docker/compose/v2/cmd@$COMPOSE_VERSION" >&2
  fi
  mkdir -p "$PLUGIN_DIR"
  cmp -s "$COMPOSE_BIN" "$PLUGIN_DIR/docker-compose" || cp "$COMPOSE_BIN" "$PLUGIN_DIR/docker-compose"
  "$DOCKER" compose version >/dev/null || die "docker compose does not run the installed plugin"
  log "docker compose $COMPOSE_VERSION ready ($PLUGIN_DIR/docker-compose)"
}

# build_image NAME CONTEXT: build $HERE/NAME.Dockerfile in CONTEXT as kiln/stack-NAME:<inputs hash> and :local.
build_image() {
  local name=$1 ctx=$2 base tag
  base=$("$DOCKER" image inspect --format '{{.Id}}' kiln/base:latest)
  tag="kiln/stack-$name:$( (echo "$base"; cat "$HERE/$name.Dockerfile"; find "$ctx" -type f -printf '%P %s\n' | sort) \
    | sha256sum | cut -c1-12)"
  if ! "$DOCKER" image inspect "$tag" >/dev/null 2>&1; then
    log "building $tag"
    cp "$HERE/$name.Dockerfile" "$ctx/Dockerfile"
    "$DOCKER" build --network host --build-arg BASE_IMAGE=kiln/base:latest -t "$tag" "$ctx" >"$ctx.log" 2>&1 \
      || { tail -30 "$ctx.log" >&2; die "building $tag failed"; }
    rm -f "$ctx.log"
  fi
  "$DOCKER" tag "$tag" "kiln/stack-$name:local"
  echo "$name=$tag"
}

images() {
  "$INFRA_DIR/docker/docker.sh" base >/dev/null
  "$INFRA_DIR/kafka/kafka.sh" install
  "$INFRA_DIR/s3/s3.sh" install
  local work; work=$(mktemp -d "$KILN_CACHE/stack-images.XXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  mkdir -p "$work/kafka" "$work/s3" "$work/registry" "$work/prometheus"
  cp -a "$("$INFRA_DIR/kafka/kafka.sh" home)/libs" "$work/kafka/libs"
  cp "$HERE/kafka-entrypoint.sh" "$work/kafka/"
  cp "$("$INFRA_DIR/s3/s3.sh" bin)" "$work/s3/versitygw"
  build_image kafka "$work/kafka"
  build_image s3 "$work/s3"
  build_image registry "$work/registry"
  build_image prometheus "$work/prometheus"
}

status() {
  "$DOCKER" compose version 2>/dev/null || { echo "docker compose not installed"; return 1; }
  "$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^kiln/stack-' | sed 's/^/  /' || true
}

case "${1:-}" in
  install) install ;;
  images) images ;;
  status) status ;;
  *) echo "usage: $0 install|images|status" >&2; exit 2 ;;
esac
