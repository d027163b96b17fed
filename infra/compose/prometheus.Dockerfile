# kiln/stack-prometheus: Debian's prometheus, reading /etc/prometheus/prometheus.yml like prom/prometheus.
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      prometheus && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown 1000:1000 /prometheus
USER 1000:1000
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
