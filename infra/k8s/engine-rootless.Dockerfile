# The engine sidecar of build and exec pods, rootless (KILN_K8S_ENGINE=rootless; the render's default engine is the
# equivalent docker:dind-rootless): dockerd as uid 1000 in its user namespace. On a cgroup-v1 node it runs "without
# cgroups": sandboxes get no memory, pids or CPU limit there (engine-rootful.Dockerfile).
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      docker.io rootlesskit uidmap iptables && rm -rf /var/lib/apt/lists/* \
    && echo kiln:100000:65536 >>/etc/subuid && echo kiln:100000:65536 >>/etc/subgid \
    && mkdir -p /run/user/1000 && chown kiln:kiln /run/user/1000
USER 1000
ENV XDG_RUNTIME_DIR=/run/user/1000 HOME=/home/kiln DOCKERD_ROOTLESS_ROOTLESSKIT_NET=host \
    DOCKERD_ROOTLESS_ROOTLESSKIT_PORT_DRIVER=none
ENTRYPOINT ["/usr/share/docker.io/contrib/dockerd-rootless.sh"]
