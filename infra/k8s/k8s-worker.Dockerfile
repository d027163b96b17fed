# kiln's worker image for the cluster (cluster.sh images): infra/docker/worker.Dockerfile's image plus bubblewrap
# (the Lean worker runs every REPL in it and refuses to start without) and the fake Lean REPL, the one sanctioned
# stand-in for Lean (tests/fakes/lean_repl.py says it is one: Lean cannot be built here), for KILN_LEAN_REPL.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
USER root
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
COPY lean_repl.py /opt/kiln/fakes/lean_repl.py
USER 1000:1000
