#!/usr/bin/env bash
# Apache Kafka from Maven Central jars: one KRaft broker+controller on 127.0.0.1 with share groups enabled.
#   kafka.sh install   resolve the pinned jars into $KILN_CACHE/kafka-<version>/libs (mvn, cached)
#   kafka.sh start     install, write config, format once, start, wait until it serves requests (idempotent)
#   kafka.sh stop      stop the broker (idempotent)
#   kafka.sh status    exit 0 when the broker answers on its port
#   kafka.sh home      the installed jars' directory (its libs/ holds them)
# Env: KILN_KAFKA_PORT (9092), KILN_KAFKA_CONTROLLER_PORT (port+1), KILN_KAFKA_SASL_PORT (port+2),
#      KILN_KAFKA_HEAP (512m), KILN_KAFKA_DATA, KILN_KAFKA_START_TIMEOUT (600 s: a broker holding thousands of
#      partitions loads each log before it opens its port, minutes on a busy 2-core machine),
#      KILN_KAFKA_SHARE_GROUPS (1; 0 formats without share.version, like a broker that lacks share groups).
# Two client listeners: PLAINTEXT on the port (loopback only: the local admin path, a super user) and
# SASL_PLAINTEXT with SCRAM-SHA-256 on port+2, where the StandardAuthorizer lets a principal do only what its ACLs
# allow (nothing by default). Users and ACLs are made through the admin API (tests/streams/test_sasl.py shows how).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$INFRA_DIR/kafka/pom.xml")
POM_HASH=$(sha256sum "$INFRA_DIR/kafka/pom.xml" | cut -c1-12)
KAFKA_HOME="$KILN_CACHE/kafka-$KAFKA_VERSION-$POM_HASH"
PORT="${KILN_KAFKA_PORT:-9092}"
CONTROLLER_PORT="${KILN_KAFKA_CONTROLLER_PORT:-$((PORT + 1))}"
SASL_PORT="${KILN_KAFKA_SASL_PORT:-$((PORT + 2))}"
HEAP="${KILN_KAFKA_HEAP:-512m}"
DATA="${KILN_KAFKA_DATA:-$KILN_RUN/kafka-$PORT}"
PIDFILE="$DATA/kafka.pid"
SHARE_GROUPS="${KILN_KAFKA_SHARE_GROUPS:-1}"

install() {
  [[ -f $KAFKA_HOME/.complete ]] && return 0
  log "resolving Apache Kafka $KAFKA_VERSION from Maven Central"
  rm -rf "$KAFKA_HOME"
  mvn -q -B -f "$INFRA_DIR/kafka/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$KAFKA_HOME/libs" >&2
  touch "$KAFKA_HOME/.complete"
}

write_config() {
  mkdir -p "$DATA/logs"
  # Single node on loopback: every internal topic has replication 1 and min ISR 1, rebalances start at once.
  cat >"$DATA/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT,SASL_PLAINTEXT://127.0.0.1:$SASL_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT,SASL_PLAINTEXT://127.0.0.1:$SASL_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-256
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:ANONYMOUS
allow.everyone.if.no.acl.found=false
log.dirs=$DATA/data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.consumer.min.session.timeout.ms=3000
group.consumer.session.timeout.ms=10000
group.consumer.heartbeat.interval.ms=1000
group.consumer.min.heartbeat.interval.ms=500
group.classic.min.session.timeout.ms=3000
group.share.min.record.lock.duration.ms=1000
group.share.record.lock.duration.ms=30000
# The maximum: a SIGKILLed process can spend several deliveries of one record (see streams/share.py).
group.share.delivery.count.limit=10
message.max.bytes=1048588
log.retention.check.interval.ms=300000
EOF
  cat >"$DATA/log4j2.yaml" <<EOF
Configuration:
  Appenders:
    RollingFile:
      name: File
      fileName: "$DATA/logs/server.log"
      filePattern: "$DATA/logs/server.log.%i"
      PatternLayout: { pattern: "[%d] %p %m (%c)%n" }
      Policies: { SizeBasedTriggeringPolicy: { size: 50MB } }
      DefaultRolloverStrategy: { max: 2 }
  Loggers:
    Root: { level: INFO, AppenderRef: [ { ref: File } ] }
    Logger:
      - { name: kafka.request.logger, level: WARN }
      - { name: org.apache.kafka.controller, level: WARN }
EOF
}

java_cmd() {
  java "-Xmx$HEAP" "-Xms$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    "-Dlog4j2.configurationFile=$DATA/log4j2.yaml" -cp "$KAFKA_HOME/libs/*" "$@"
}

format() {
  [[ -f $DATA/data/meta.properties ]] && return 0
  local share_feature=share.version=1
  [[ $SHARE_GROUPS == 1 ]] || share_feature=share.version=0
  log "formatting KRaft storage in $DATA/data ($share_feature)"
  java_cmd kafka.tools.StorageTool format --standalone --cluster-id "kiln-$(printf '%016d' "$PORT")" \
    --config "$DATA/server.properties" --feature "$share_feature" >"$DATA/logs/format.log" 2>&1 \
    || { cat "$DATA/logs/format.log" >&2; die "kafka format failed"; }
}

partition_count() { find "$DATA/data" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l; }

start() {
  install
  write_config
  local key; key=$(sha256sum "$DATA/server.properties" | cut -c1-16)
  if same_config_running "$PIDFILE" "$DATA/config.key" "$key"; then
    log "kafka already running on 127.0.0.1:$PORT"; return 0
  fi
  pid_alive "$PIDFILE" && stop_pidfile "$PIDFILE" kafka  # started with another configuration: restart
  tcp_open 127.0.0.1 "$PORT" && die "port $PORT is taken by another process"
  tcp_open 127.0.0.1 "$SASL_PORT" && die "port $SASL_PORT (SASL listener) is taken by another process"
  format
  echo "$key" >"$DATA/config.key"
  log "starting kafka $KAFKA_VERSION on 127.0.0.1:$PORT (heap $HEAP)"
  nohup java "-Xmx$HEAP" "-Xms$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    "-Dlog4j2.configurationFile=$DATA/log4j2.yaml" -cp "$KAFKA_HOME/libs/*" kafka.Kafka "$DATA/server.properties" \
    >"$DATA/logs/stdout.log" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  local timeout="${KILN_KAFKA_START_TIMEOUT:-600}" began=$SECONDS next_report=$((SECONDS + 30))
  until tcp_open 127.0.0.1 "$PORT" && grep -q "Kafka Server started" "$DATA/logs/server.log" 2>/dev/null; do
    pid_alive "$PIDFILE" || { tail -30 "$DATA/logs/stdout.log" "$DATA/logs/server.log" >&2 || true; die "kafka exited"; }
    if ((SECONDS - began >= timeout)); then
      tail -5 "$DATA/logs/server.log" >&2 || true
      die "kafka did not open port $PORT in ${timeout}s (KILN_KAFKA_START_TIMEOUT)"
    fi
    if ((SECONDS >= next_report)); then
      log "kafka still starting after $((SECONDS - began))s: $(partition_count) partition logs in $DATA/data"
      next_report=$((SECONDS + 30))
    fi
    sleep 0.3
  done
  log "kafka ready on 127.0.0.1:$PORT"
}

status() {
  if pid_alive "$PIDFILE" && tcp_open 127.0.0.1 "$PORT"; then
    echo "kafka $KAFKA_VERSION running on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), data $DATA)"
  else
    echo "kafka not running on 127.0.0.1:$PORT"; return 1
  fi
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop_pidfile "$PIDFILE" kafka ;;
  status) status ;;
  version) echo "$KAFKA_VERSION" ;;
  home) echo "$KAFKA_HOME" ;;
  *) echo "usage: $0 install|start|stop|status|version|home" >&2; exit 2 ;;
esac
