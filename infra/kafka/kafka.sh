#!/usr/bin/env bash
# Apache Kafka from Maven Central jars: KRaft broker+controller nodes on 127.0.0.1 with share groups enabled — one
# by default, or a replicated cluster of KILN_KAFKA_BROKERS nodes (each broker + controller voter).
#   kafka.sh install   resolve the pinned jars into $KILN_CACHE/kafka-<version>/libs (mvn, cached)
#   kafka.sh start     install, write config, format once, start, wait until it serves requests (idempotent)
#   kafka.sh stop      stop the broker(s) (idempotent)
#   kafka.sh status    exit 0 when every broker answers on its port
#   kafka.sh bootstrap the bootstrap servers (host:port,...) of the broker or cluster these settings describe
#   kafka.sh pids      "node_id pid" of each running node (for fault injection: a bench kills and restarts them)
#   kafka.sh start-node N / stop-node N   one node of a cluster (its restart after a kill)
#   kafka.sh home      the installed jars' directory (its libs/ holds them)
#   kafka.sh bootstrap-nodes   the bootstrap servers of the nodes' listener (KILN_KAFKA_NODES_ADDRESS)
# Env: KILN_KAFKA_PORT (9092), KILN_KAFKA_CONTROLLER_PORT (port+1), KILN_KAFKA_SASL_PORT (port+2),
#      KILN_KAFKA_HEAP (512m), KILN_KAFKA_DATA, KILN_KAFKA_START_TIMEOUT (600 s: a broker holding thousands of
#      partitions loads each log before it opens its port, minutes on a busy 2-core machine),
#      KILN_KAFKA_SHARE_GROUPS (1; 0 formats without share.version, like a broker that lacks share groups),
#      KILN_KAFKA_BROKERS (1; N: a cluster, node i on port + 10*(i-1) (+1 controller, +2 SASL), data under
#      $KILN_RUN/kafka-<port>-x<N>/n<i>; default replication min(3, N), min.insync.replicas min(2, N), internal
#      topics likewise, unclean leader election off),
#      KILN_KAFKA_NODES_ADDRESS (unset; an address of this host, e.g. the worker nodes' bridge of infra/nodes: a
#      third client listener, NODES, PLAINTEXT on that address at port+3 of each node, for clients in other network
#      namespaces — they cannot reach loopback).
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
SHARE_GROUPS="${KILN_KAFKA_SHARE_GROUPS:-1}"
BROKERS="${KILN_KAFKA_BROKERS:-1}"
[[ $BROKERS =~ ^[1-9]$ ]] || { echo "KILN_KAFKA_BROKERS must be 1-9, not '$BROKERS'" >&2; exit 2; }
CLUSTER_DATA="${KILN_KAFKA_DATA:-$KILN_RUN/kafka-$PORT-x$BROKERS}"
REPLICATION=$((BROKERS < 3 ? BROKERS : 3))
MIN_ISR=$((BROKERS < 2 ? 1 : 2))

# use_node I: the ports, data directory and pid file of node I (a single broker keeps its historical layout).
use_node() {
  NODE=$1
  if ((BROKERS == 1)); then
    NODE_PORT=$PORT NODE_CONTROLLER=$CONTROLLER_PORT NODE_SASL=$SASL_PORT DATA="${KILN_KAFKA_DATA:-$KILN_RUN/kafka-$PORT}"
  else
    NODE_PORT=$((PORT + 10 * (NODE - 1))); NODE_CONTROLLER=$((NODE_PORT + 1)); NODE_SASL=$((NODE_PORT + 2))
    DATA="$CLUSTER_DATA/n$NODE"
  fi
  PIDFILE="$DATA/kafka.pid"
}
use_node 1

voters() {
  local i out=""
  for ((i = 1; i <= BROKERS; i++)); do out+="${out:+,}$i@127.0.0.1:$((PORT + 10 * (i - 1) + 1))"; done
  echo "$out"
}

bootstrap() {
  local i out="" address=${1:-127.0.0.1} offset=${2:-0}
  for ((i = 1; i <= BROKERS; i++)); do use_node "$i"; out+="${out:+,}$address:$((NODE_PORT + offset))"; done
  echo "$out"
}

NODES_ADDRESS="${KILN_KAFKA_NODES_ADDRESS:-}"
# listeners_config: the listener lines (loopback only, unless a nodes' address adds the NODES listener).
listeners_config() {
  local nodes="" nodes_map=""
  if [[ -n $NODES_ADDRESS ]]; then nodes=",NODES://$NODES_ADDRESS:$((NODE_PORT + 3))" nodes_map=",NODES:PLAINTEXT"; fi
  echo "listeners=PLAINTEXT://127.0.0.1:$NODE_PORT,CONTROLLER://127.0.0.1:$NODE_CONTROLLER,SASL_PLAINTEXT://127.0.0.1:$NODE_SASL$nodes"
  echo "advertised.listeners=PLAINTEXT://127.0.0.1:$NODE_PORT,CONTROLLER://127.0.0.1:$NODE_CONTROLLER,SASL_PLAINTEXT://127.0.0.1:$NODE_SASL$nodes"
  echo "controller.listener.names=CONTROLLER"
  echo "inter.broker.listener.name=PLAINTEXT"
  echo "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT$nodes_map"
}

install() {
  [[ -f $KAFKA_HOME/.complete ]] && return 0
  log "resolving Apache Kafka $KAFKA_VERSION from Maven Central"
  rm -rf "$KAFKA_HOME"
  mvn -q -B -f "$INFRA_DIR/kafka/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$KAFKA_HOME/libs" >&2
  touch "$KAFKA_HOME/.complete"
}

# The quorum line and the replication lines: a single node's (replication 1, min ISR 1; byte for byte what it has
# always been, so an upgrade does not restart a running broker), or a cluster's.
quorum_config() {
  if ((BROKERS == 1)); then echo "controller.quorum.bootstrap.servers=127.0.0.1:$NODE_CONTROLLER"
  else echo "controller.quorum.voters=$(voters)"; fi
}

replication_config() {
  if ((BROKERS == 1)); then
    printf '%s\n' offsets.topic.replication.factor=1 offsets.topic.num.partitions=8 \
      transaction.state.log.replication.factor=1 transaction.state.log.min.isr=1 \
      share.coordinator.state.topic.replication.factor=1 share.coordinator.state.topic.min.isr=1
  else
    printf '%s\n' "default.replication.factor=$REPLICATION" "min.insync.replicas=$MIN_ISR" \
      unclean.leader.election.enable=false "offsets.topic.replication.factor=$REPLICATION" \
      offsets.topic.num.partitions=8 "transaction.state.log.replication.factor=$REPLICATION" \
      "transaction.state.log.min.isr=$MIN_ISR" "share.coordinator.state.topic.replication.factor=$REPLICATION" \
      "share.coordinator.state.topic.min.isr=$MIN_ISR"
  fi
}

# The KIP-848 heartbeat interval: 1 s on a single broker (rebalances in the tests settle fast); 3 s on a cluster,
# where librdkafka times a ConsumerGroupHeartbeat out after one interval and a broker fault (offset commits waiting for
# the offsets log in sync, queued before the heartbeat on the coordinator's connection) or a loaded machine delays it
# past 1 s: with 1 s, a member whose heartbeat carrying its new assignment timed out kept all 16 partitions for 4.5
# minutes while two new members waited (bench/cluster at load 100). The session stays 10 s: three heartbeats.
heartbeat_interval_ms() { if ((BROKERS == 1)); then echo 1000; else echo 3000; fi; }

write_config() {
  mkdir -p "$DATA/logs"
  # Loopback only; rebalances start at once.
  cat >"$DATA/server.properties" <<EOF
process.roles=broker,controller
node.id=$NODE
$(quorum_config)
$(listeners_config)
sasl.enabled.mechanisms=SCRAM-SHA-256
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:ANONYMOUS
allow.everyone.if.no.acl.found=false
log.dirs=$DATA/data
num.partitions=1
auto.create.topics.enable=false
$(replication_config)
group.initial.rebalance.delay.ms=0
group.consumer.min.session.timeout.ms=3000
group.consumer.session.timeout.ms=10000
group.consumer.heartbeat.interval.ms=$(heartbeat_interval_ms)
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
  local share_feature=share.version=1 quorum=(--standalone)
  [[ $SHARE_GROUPS == 1 ]] || share_feature=share.version=0
  ((BROKERS == 1)) || quorum=()  # a cluster's voters are static (controller.quorum.voters)
  log "formatting KRaft storage in $DATA/data ($share_feature)"
  java_cmd kafka.tools.StorageTool format "${quorum[@]}" --cluster-id "kiln-$(printf '%016d' "$PORT")" \
    --config "$DATA/server.properties" --feature "$share_feature" >"$DATA/logs/format.log" 2>&1 \
    || { cat "$DATA/logs/format.log" >&2; die "kafka format failed"; }
}

partition_count() { find "$DATA/data" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l; }

# launch_node I: write node I's config, format it once, start it unless it runs with that config already.
launch_node() {
  use_node "$1"
  write_config
  local key; key=$(sha256sum "$DATA/server.properties" | cut -c1-16)
  if same_config_running "$PIDFILE" "$DATA/config.key" "$key"; then
    log "kafka node $NODE already running on 127.0.0.1:$NODE_PORT"; return 0
  fi
  pid_alive "$PIDFILE" && stop_pidfile "$PIDFILE" kafka  # started with another configuration: restart
  tcp_open 127.0.0.1 "$NODE_PORT" && die "port $NODE_PORT is taken by another process"
  tcp_open 127.0.0.1 "$NODE_SASL" && die "port $NODE_SASL (SASL listener) is taken by another process"
  format
  echo "$key" >"$DATA/config.key"
  log "starting kafka $KAFKA_VERSION node $NODE on 127.0.0.1:$NODE_PORT (heap $HEAP)"
  nohup java "-Xmx$HEAP" "-Xms$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    "-Dlog4j2.configurationFile=$DATA/log4j2.yaml" -cp "$KAFKA_HOME/libs/*" kafka.Kafka "$DATA/server.properties" \
    >"$DATA/logs/stdout.log" 2>&1 </dev/null 9>&- &  # not the start lock's fd: the node would hold it for life
  echo $! >"$PIDFILE"
}

# await_node I: until node I serves requests (a cluster's nodes each wait for a quorum of controllers).
await_node() {
  use_node "$1"
  local timeout="${KILN_KAFKA_START_TIMEOUT:-600}" began=$SECONDS next_report=$((SECONDS + 30))
  until tcp_open 127.0.0.1 "$NODE_PORT" && grep -q "Kafka Server started" "$DATA/logs/server.log" 2>/dev/null; do
    pid_alive "$PIDFILE" || { tail -30 "$DATA/logs/stdout.log" "$DATA/logs/server.log" >&2 || true; die "kafka exited"; }
    if ((SECONDS - began >= timeout)); then
      tail -5 "$DATA/logs/server.log" >&2 || true
      die "kafka did not open port $NODE_PORT in ${timeout}s (KILN_KAFKA_START_TIMEOUT)"
    fi
    if ((SECONDS >= next_report)); then
      log "kafka node $NODE still starting after $((SECONDS - began))s: $(partition_count) partition logs in $DATA/data"
      next_report=$((SECONDS + 30))
    fi
    sleep 0.3
  done
  log "kafka node $NODE ready on 127.0.0.1:$NODE_PORT"
}

# warn_ephemeral: the nodes' ports inside Linux's ephemeral range — while a node is down, any outgoing connection can
# be handed its port as its local one (a client reconnecting to it on loopback even connects to itself), and the node's
# restart cannot bind it.
warn_ephemeral() {
  local low high last=$((PORT + 10 * (BROKERS - 1) + 3))
  read -r low high </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || return 0
  if ((last >= low && PORT <= high)); then
    log "warning: ports $PORT-$last lie in the ephemeral range $low-$high: a node restarted there may find its port" \
      "taken as another connection's local port (\"Address already in use\"); a port below $low avoids it"
  fi
  return 0
}

start() {
  install
  warn_ephemeral
  local i
  # One start at a time per broker or cluster: two at once (two test sessions finding it down) would both launch
  # a node, and the one that loses the port would leave its pid in the pid file.
  exec 9>"$KILN_RUN/kafka-$PORT-x$BROKERS.start.lock"
  flock 9
  for ((i = 1; i <= BROKERS; i++)); do launch_node "$i"; done
  for ((i = 1; i <= BROKERS; i++)); do await_node "$i"; done
  ((BROKERS == 1)) || log "kafka cluster of $BROKERS ready: $(bootstrap) (replication $REPLICATION, min ISR $MIN_ISR)"
}

status() {
  local i down=0
  for ((i = 1; i <= BROKERS; i++)); do
    use_node "$i"
    if pid_alive "$PIDFILE" && tcp_open 127.0.0.1 "$NODE_PORT"; then
      echo "kafka $KAFKA_VERSION node $NODE running on 127.0.0.1:$NODE_PORT (pid $(cat "$PIDFILE"), data $DATA)"
    else
      echo "kafka node $NODE not running on 127.0.0.1:$NODE_PORT"; down=1
    fi
  done
  return "$down"
}

stop() {
  local i
  for ((i = 1; i <= BROKERS; i++)); do use_node "$i"; stop_pidfile "$PIDFILE" "kafka node $NODE"; done
}

pids() {
  local i
  for ((i = 1; i <= BROKERS; i++)); do use_node "$i"; pid_alive "$PIDFILE" && echo "$NODE $(cat "$PIDFILE")"; done
  return 0
}

node_arg() { [[ ${1:-} =~ ^[1-9]$ ]] && (($1 <= BROKERS)) || die "node must be 1..$BROKERS"; echo "$1"; }

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  bootstrap) bootstrap ;;
  bootstrap-nodes) [[ -n $NODES_ADDRESS ]] || die "KILN_KAFKA_NODES_ADDRESS is not set"; bootstrap "$NODES_ADDRESS" 3 ;;
  pids) pids ;;
  start-node) n=$(node_arg "${2:-}"); install; launch_node "$n"; await_node "$n" ;;
  stop-node) n=$(node_arg "${2:-}"); use_node "$n"; stop_pidfile "$PIDFILE" "kafka node $NODE" ;;
  version) echo "$KAFKA_VERSION" ;;
  home) echo "$KAFKA_HOME" ;;
  *) echo "usage: $0 install|start|stop|status|bootstrap|bootstrap-nodes|pids|start-node N|stop-node N|version|home" >&2; exit 2 ;;
esac
