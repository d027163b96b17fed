#!/bin/sh
# The rootful engine sidecar's dockerd (engine-rootful.Dockerfile): its arguments are the render's (--host on the
# pod's shared socket directory, then values.engine_args). The socket's group is the worker's (gid 1000); the data
# root is an emptyDir (overlay2 cannot stack on the container's own overlay root); sandboxes get no network
# (--bridge=none; kiln runs them with --network none) and no new privileges.
set -eu
exec dockerd --group 1000 --data-root /var/lib/docker --bridge=none --iptables=false --ip6tables=false \
  --ip-masq=false --userland-proxy=false --no-new-privileges "$@"
