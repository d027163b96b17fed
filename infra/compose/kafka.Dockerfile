# kiln/stack-kafka: Apache Kafka (KRaft, broker + controller) from Maven Central's jars, in place of Redpanda on
# machines without a hub (infra/compose/no-hub.yml). Context: libs/ (infra/kafka/kafka.sh install) + entrypoint.
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      openjdk-17-jre-headless && rm -rf /var/lib/apt/lists/*
COPY libs /opt/kafka/libs
COPY kafka-entrypoint.sh /opt/kafka/entrypoint.sh
RUN mkdir -p /var/lib/kafka && chown 1000:1000 /var/lib/kafka
USER 1000:1000
VOLUME /var/lib/kafka
ENTRYPOINT ["/opt/kafka/entrypoint.sh"]
