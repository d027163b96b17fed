# kiln/stack-registry: Debian's docker-registry (CNCF distribution 2.8) with registry:2's own configuration (Debian's
# asks for htpasswd credentials), so the same REGISTRY_* variables configure it (storage on the stack's S3).
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      docker-registry && rm -rf /var/lib/apt/lists/* && mkdir -p /var/lib/registry && chown 1000:1000 /var/lib/registry \
    && printf '%s\n' 'version: 0.1' 'log:' '  fields:' '    service: registry' 'storage:' '  cache:' \
      '    blobdescriptor: inmemory' '  filesystem:' '    rootdirectory: /var/lib/registry' 'http:' '  addr: :5000' \
      '  headers:' '    X-Content-Type-Options: [nosniff]' 'health:' '  storagedriver:' '    enabled: true' \
      '    interval: 10s' '    threshold: 3' >/etc/docker/registry/config.yml
USER 1000:1000
EXPOSE 5000
ENTRYPOINT ["/usr/bin/docker-registry", "serve", "/etc/docker/registry/config.yml"]
