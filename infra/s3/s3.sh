#!/usr/bin/env bash
# A real S3-compatible server on loopback: versitygw (Apache-2.0) with its POSIX backend, built from the Go module proxy.
#   s3.sh install | start | stop | status | env | bin (the built binary's path)
# Env: KILN_S3_PORT (7070), KILN_S3_ADDRESS (127.0.0.1; e.g. the worker nodes' bridge address, infra/nodes),
#      KILN_S3_ACCESS_KEY / KILN_S3_SECRET_KEY (default: generated once per installation under $KILN_CACHE/secrets),
#      KILN_S3_DATA.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

VERSITYGW_VERSION=v1.8.0
BIN_DIR="$KILN_CACHE/versitygw-$VERSITYGW_VERSION"
BIN="$BIN_DIR/versitygw"
ADDRESS="${KILN_S3_ADDRESS:-127.0.0.1}"
PORT="${KILN_S3_PORT:-7070}"
ACCESS_KEY="${KILN_S3_ACCESS_KEY:-kiln$(installation_secret s3-access-key | cut -c1-12)}"
SECRET_KEY="${KILN_S3_SECRET_KEY:-$(installation_secret s3-secret-key)}"
DATA="${KILN_S3_DATA:-$KILN_RUN/s3-$PORT}"
PIDFILE="$DATA/versitygw.pid"

install() {
  [[ -x $BIN ]] && return 0
  log "building versitygw $VERSITYGW_VERSION from the Go module proxy (a few minutes, once)"
  mkdir -p "$BIN_DIR"
  GOBIN="$BIN_DIR" GOFLAGS=-trimpath go install "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION" >&2
}

s3_ready() { curl -s -o /dev/null "http://$ADDRESS:$PORT/"; }

start() {
  local key; key=$(printf '%s:%s' "$ACCESS_KEY" "$SECRET_KEY" | sha256sum | cut -c1-16)
  if same_config_running "$PIDFILE" "$DATA/config.key" "$key"; then log "s3 already running on $ADDRESS:$PORT"; return 0; fi
  pid_alive "$PIDFILE" && stop_pidfile "$PIDFILE" versitygw  # other credentials: restart with these
  tcp_open "$ADDRESS" "$PORT" && die "port $PORT is taken by another process"
  install
  mkdir -p "$DATA/buckets" "$DATA/versions"
  log "starting versitygw on $ADDRESS:$PORT"
  ROOT_ACCESS_KEY="$ACCESS_KEY" ROOT_SECRET_KEY="$SECRET_KEY" nohup "$BIN" --port "$ADDRESS:$PORT" --quiet \
    posix "$DATA/buckets" >"$DATA/versitygw.log" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  echo "$key" >"$DATA/config.key"
  wait_for versitygw 30 s3_ready
  log "s3 ready on http://$ADDRESS:$PORT"
}

status() {
  if pid_alive "$PIDFILE" && s3_ready; then echo "s3 (versitygw $VERSITYGW_VERSION) running on http://$ADDRESS:$PORT"
  else echo "s3 not running on $ADDRESS:$PORT"; return 1; fi
}

# The variables kiln (and boto3) read to reach this server.
print_env() {
  printf 'KILN_S3_ENDPOINT=http://%s:%s\nKILN_S3_ACCESS_KEY=%s\nKILN_S3_SECRET_KEY=%s\nKILN_S3_REGION=us-east-1\n' \
    "$ADDRESS" "$PORT" "$ACCESS_KEY" "$SECRET_KEY"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop_pidfile "$PIDFILE" versitygw ;;
  status) status ;;
  env) print_env ;;
  bin) echo "$BIN" ;;
  *) echo "usage: $0 install|start|stop|status|env|bin" >&2; exit 2 ;;
esac
