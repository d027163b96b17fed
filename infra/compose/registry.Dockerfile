# kiln/stack-registry: Debian's docker-registry (CNCF distribution 2.8), configured like registry:2 by
# REGISTRY_* variables (storage on the stack's S3).
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      docker-registry && rm -rf /var/lib/apt/lists/*
USER 1000:1000
EXPOSE 5000
ENTRYPOINT ["/usr/bin/docker-registry", "serve", "/etc/docker/registry/config.yml"]
