# kiln worker image: every kiln service of docker-compose.yml runs from it (workers of every stage, Saucer, the
# gateway, the stats stream, the status page, `kiln init`), so it carries the extras they import (worker, ops, s3)
# and the exec supervisor's static binary. One image rather than one per role: the extras add ~60 MB to a ~200 MB
# image, and one image is built, cached and pulled once for the whole stack.
# Users build FROM a slim Python image and Go's; on machines without a hub the local images are passed:
#   docker build --network host --build-arg BASE_IMAGE=kiln/base:latest \
#     --build-arg TOOLCHAIN_IMAGE=kiln/toolchain:latest -f infra/docker/worker.Dockerfile .
ARG BASE_IMAGE=python:3.11-slim
ARG TOOLCHAIN_IMAGE=golang:1.23-bookworm

# The exec supervisor (workers/exec/supervisor): copied into every runner container, built here once.
FROM ${TOOLCHAIN_IMAGE} AS supervisor
COPY workers/exec/supervisor /src
RUN cd /src && CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local go build -trimpath -ldflags=-s -o /exec-supervisor .

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    KILN_METRICS_HOST=0.0.0.0 KILN_METRICS_PORT=9100 KILN_CACHE=/var/lib/kiln \
    KILN_EXEC_SUPERVISOR=/opt/kiln/exec-supervisor
# git: Saucer's ingestion fetches and packs with it (the local base already has it; slim images do not).
RUN command -v git >/dev/null || (apt-get update && apt-get install -y --no-install-recommends git ca-certificates \
    && rm -rf /var/lib/apt/lists/*)
RUN python3 -m venv /opt/kiln && mkdir -p /var/lib/kiln && chown 1000:1000 /var/lib/kiln
# Dependencies first, keyed by pyproject.toml only, so source edits reuse this layer.
# The dependency layer is keyed by pyproject.toml alone (a README edit must not reinstall every dependency): pip
# reads the project's metadata from a stand-in README and package, the real ones come in the layer below.
COPY pyproject.toml /src/
RUN mkdir -p /src/kiln && touch /src/kiln/__init__.py /src/README.md \
    && /opt/kiln/bin/pip install --no-cache-dir --disable-pip-version-check "/src[worker,ops,s3]" \
    && rm -rf /src
COPY --from=supervisor /exec-supervisor /opt/kiln/exec-supervisor
COPY . /src
RUN /opt/kiln/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps /src && rm -rf /src
USER 1000:1000
EXPOSE 9100
HEALTHCHECK --interval=10s --timeout=15s --retries=5 --start-period=120s CMD ["/opt/kiln/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ['KILN_METRICS_PORT']}/healthz\", timeout=2)"]
ENTRYPOINT ["/opt/kiln/bin/kiln"]
CMD ["worker", "echo"]
