#!/usr/bin/env bash
# One KRaft node (broker + controller) for the compose stack, share groups enabled like kiln's local broker.
# Two client listeners: INTERNAL (the stack's network, advertised as $KAFKA_INTERNAL_HOST:29092) and EXTERNAL
# (published on the host's loopback, advertised as 127.0.0.1:$KAFKA_EXTERNAL_PORT: trainers on the host and the
# host-network workers). Env: KAFKA_INTERNAL_HOST (broker), KAFKA_EXTERNAL_PORT (9092), KAFKA_HEAP (512m).
set -euo pipefail
DATA=/var/lib/kafka
INTERNAL_HOST="${KAFKA_INTERNAL_HOST:-broker}"
EXTERNAL_PORT="${KAFKA_EXTERNAL_PORT:-9092}"
HEAP="${KAFKA_HEAP:-512m}"
cat >"$DATA/server.properties" <<CFG
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:29093
listeners=INTERNAL://0.0.0.0:29092,EXTERNAL://0.0.0.0:$EXTERNAL_PORT,CONTROLLER://127.0.0.1:29093
advertised.listeners=INTERNAL://$INTERNAL_HOST:29092,EXTERNAL://127.0.0.1:$EXTERNAL_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,EXTERNAL:PLAINTEXT
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
group.share.delivery.count.limit=10
CFG
JAVA=(java "-Xmx$HEAP" "-Xms$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true -cp "/opt/kafka/libs/*")
if [[ ! -f $DATA/data/meta.properties ]]; then
  "${JAVA[@]}" kafka.tools.StorageTool format --standalone --cluster-id kiln-compose-stack0 \
    --config "$DATA/server.properties" --feature share.version=1
fi
exec "${JAVA[@]}" kafka.Kafka "$DATA/server.properties"
