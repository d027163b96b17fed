#!/usr/bin/env bash
# Debian's docker-registry (CNCF distribution 2.8) on 127.0.0.1 (or KILN_REGISTRY_ADDRESS), storing into the S3
# server (infra/s3).
# Every request needs credentials (htpasswd, bcrypt): user kiln, password generated once per installation
# ($KILN_CACHE/secrets/registry-password); `registry.sh env` prints them for kiln (KILN_BUILD_REGISTRY_USER/
# _PASSWORD) and for `docker login`.
#   registry.sh start | stop | status | env
# Env: KILN_REGISTRY_PORT (5000), KILN_REGISTRY_ADDRESS (127.0.0.1; e.g. the worker nodes' bridge address,
#      infra/nodes), KILN_REGISTRY_BUCKET (kiln-registry); S3 settings as in infra/s3/s3.sh.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

ADDRESS="${KILN_REGISTRY_ADDRESS:-127.0.0.1}"
PORT="${KILN_REGISTRY_PORT:-5000}"
BUCKET="${KILN_REGISTRY_BUCKET:-kiln-registry}"
DATA="$KILN_RUN/registry-$PORT"
PIDFILE="$DATA/registry.pid"
USER_NAME=kiln
PASSWORD="$(installation_secret registry-password)"
eval "$("$INFRA_DIR/s3/s3.sh" env)"

registry_ready() { curl -sf -u "$USER_NAME:$PASSWORD" "http://$ADDRESS:$PORT/v2/" >/dev/null; }

create_bucket() {
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --aws-sigv4 "aws:amz:$KILN_S3_REGION:s3" \
    -H "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" \
    --user "$KILN_S3_ACCESS_KEY:$KILN_S3_SECRET_KEY" -X PUT "$KILN_S3_ENDPOINT/$BUCKET")
  # 200 created; 409 already exists (owned by us).
  [[ $code == 200 || $code == 409 ]] || die "creating bucket $BUCKET on $KILN_S3_ENDPOINT failed (HTTP $code)"
}

write_config() {
  mkdir -p "$DATA"
  cat >"$DATA/config.yml" <<CFG
version: 0.1
log:
  level: warn
  accesslog: { disabled: true }
storage:
  s3:
    accesskey: $KILN_S3_ACCESS_KEY
    secretkey: $KILN_S3_SECRET_KEY
    region: $KILN_S3_REGION
    regionendpoint: $KILN_S3_ENDPOINT
    bucket: $BUCKET
    secure: false
    v4auth: true
    chunksize: 5242880
    rootdirectory: /
  # Clients must not be redirected to presigned S3 URLs: the S3 server is loopback-only.
  redirect: { disable: true }
  delete: { enabled: true }
  cache: { blobdescriptor: inmemory }
auth:
  htpasswd:
    realm: kiln-registry
    path: $DATA/htpasswd
http:
  addr: $ADDRESS:$PORT
  secret: $(installation_secret registry-http-secret)
health:
  storagedriver: { enabled: true, interval: 10s, threshold: 3 }
CFG
}

start() {
  "$INFRA_DIR/s3/s3.sh" start
  local key; key=$(printf '%s:%s:%s' "$PASSWORD" "$KILN_S3_ACCESS_KEY" "$KILN_S3_SECRET_KEY" | sha256sum | cut -c1-16)
  if same_config_running "$PIDFILE" "$DATA/config.key" "$key"; then
    log "registry already running on $ADDRESS:$PORT"; return 0
  fi
  pid_alive "$PIDFILE" && stop_pidfile "$PIDFILE" docker-registry  # other credentials: restart with these
  tcp_open "$ADDRESS" "$PORT" && die "port $PORT is taken by another process"
  command -v docker-registry >/dev/null || apt_install docker-registry
  command -v htpasswd >/dev/null || apt_install apache2-utils
  create_bucket
  write_config
  (umask 077; htpasswd -Bbn "$USER_NAME" "$PASSWORD" >"$DATA/htpasswd")
  echo "$key" >"$DATA/config.key"
  log "starting docker-registry on $ADDRESS:$PORT (storage: s3://$BUCKET at $KILN_S3_ENDPOINT)"
  # AWS_CA_BUNDLE (set on these machines) makes the registry's AWS SDK panic on its custom transport.
  nohup env -u AWS_CA_BUNDLE docker-registry serve "$DATA/config.yml" >"$DATA/registry.log" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  wait_for docker-registry 30 registry_ready
  log "registry ready on http://$ADDRESS:$PORT"
}

status() {
  if pid_alive "$PIDFILE" && registry_ready; then echo "registry running on http://$ADDRESS:$PORT (s3://$BUCKET)"
  else echo "registry not running on $ADDRESS:$PORT"; return 1; fi
}

print_env() {
  printf 'KILN_BUILD_REGISTRY=%s:%s\nKILN_BUILD_REGISTRY_USER=%s\nKILN_BUILD_REGISTRY_PASSWORD=%s\n' \
    "$ADDRESS" "$PORT" "$USER_NAME" "$PASSWORD"
}

case "${1:-}" in
  start) start ;;
  stop) stop_pidfile "$PIDFILE" docker-registry ;;
  status) status ;;
  env) print_env ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
