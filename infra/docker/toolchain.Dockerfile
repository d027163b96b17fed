# kiln/toolchain: the local base plus build tools and the host's Go, Rust, Python and Node toolchains.
# Debian bookworm's own rustc (1.63) and Go (1.19) are too old for current projects, and rustup/go.dev
# downloads are unreachable here, so infra/docker/docker.sh copies the host's toolchains into the context.
# The copied Python/Node/Cargo do not look at Debian's CA bundle on their own: point them at it (the base image
# trusts the host's local CAs there).
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
# llvm-22 (bookworm-security) matches the LLVM of the host's rustc: llvm-profdata/llvm-cov for Rust coverage.
# autoconf/automake/libtool: C projects whose sources carry configure.ac but no generated configure.
RUN echo 'deb http://deb.debian.org/debian-security bookworm-security main' > /etc/apt/sources.list.d/security.list \
    && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      build-essential cmake pkg-config make curl xz-utils llvm-22 autoconf automake libtool \
    && rm -rf /var/lib/apt/lists/*
COPY go /usr/local/go
COPY rust /opt/rust
COPY python /opt/python
COPY node /opt/node
ENV PATH=/opt/node/bin:/usr/local/go/bin:/opt/rust/bin:/opt/python/bin:/usr/lib/llvm-22/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    GOTOOLCHAIN=local \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt \
    CARGO_HTTP_CAINFO=/etc/ssl/certs/ca-certificates.crt \
    CARGO_HOME=/opt/cargo-home
# Scripts copied from the host (pip, ...) carry the host's interpreter path in their shebang.
RUN grep -lIr '^#!.*python' /opt/python/bin | xargs -r sed -i '1s|^#!.*python.*$|#!/opt/python/bin/python3|' \
    && echo /opt/python/lib > /etc/ld.so.conf.d/kiln-python.conf && ldconfig \
    && mkdir -p /opt/cargo-home && chmod 1777 /opt/cargo-home && go version && rustc --version && cargo --version && python3 --version && node --version && npm --version
