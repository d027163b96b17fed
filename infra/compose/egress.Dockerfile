# The compose stack's egress proxy (the `egress` service): kiln's egress boundary (infra/egress/egress.sh serve) in a
# container on the host's network, so build sandboxes on the stack's egress network reach package registries through
# tinyproxy and nothing else. Context: infra/.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      tinyproxy iptables ebtables iproute2 curl ca-certificates && rm -rf /var/lib/apt/lists/* \
    && (id -u kiln-egress >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin kiln-egress)
COPY lib.sh /opt/kiln-infra/lib.sh
COPY egress/egress.sh /opt/kiln-infra/egress/egress.sh
ENV KILN_CACHE=/var/lib/kiln-egress/cache
ENTRYPOINT ["bash", "/opt/kiln-infra/egress/egress.sh", "serve"]
