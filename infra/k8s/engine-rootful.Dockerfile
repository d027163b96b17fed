# The engine sidecar of build and exec pods, rootful (cluster.sh images, KILN_K8S_ENGINE=rootful): Debian's dockerd
# as root in the privileged sidecar, in the pod's own cgroups. On a cgroup-v1 node a rootless dockerd runs "without
# cgroups" and cannot enforce a sandbox's --memory, --pids-limit or --cpus; a rootful one can. The price: an escape
# from a sandbox and then from dockerd is root in a privileged container, i.e. on the node — keep such pods on the
# tainted sandbox pool (the render's nodeSelector and tolerations) and prefer rootless engines on cgroup-v2 nodes.
# It also runs kiln's egress proxy for build steps (infra/egress/egress.sh, the one the host and nodes run).
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io \
      tinyproxy iptables ebtables \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --no-create-home --shell /usr/sbin/nologin kiln-egress
COPY lib.sh /opt/kiln/infra/lib.sh
COPY egress.sh /opt/kiln/infra/egress/egress.sh
COPY engine-entrypoint.sh /usr/local/bin/kiln-engine
ENTRYPOINT ["/usr/local/bin/kiln-engine"]
