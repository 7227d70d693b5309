# The nvmeof-gateway image: nvmeof-gateway, nvmeof-control and nvmeofctl on a minimal Debian
# bookworm runtime layer. Build it with scripts/build-image.sh (docs/container-image.md).
#
# The binaries are not compiled here: they are the release binaries built on the host
# (cargo build --release -p nvmeof-gateway -p control-plane --bins), taken from the build
# context at target/release/ (the .dockerignore lets nothing else in). The host's glibc must
# not be newer than bookworm's (2.36): build on bookworm, as CI does; the ldd check below
# fails the build otherwise.
#
# BASE names a Debian bookworm image. No registry is reachable where this project is tested,
# so scripts/build-image.sh makes one locally (debootstrap --variant=minbase bookworm, then
# docker import) under the tag it passes here; with a registry, debian:bookworm-slim works.
ARG BASE=nvmeof-base/debian:bookworm-minbase
FROM ${BASE}

# Runtime libraries only: librbd/librados (RBD), libibverbs/librdmacm (RDMA) and the verbs
# providers (ibverbs-providers: rxe, mlx5, ...), CA certificates (TLS to the control plane).
# No recommends, no apt lists left behind.
RUN set -eux; \
    export DEBIAN_FRONTEND=noninteractive; \
    apt-get update; \
    apt-get install -y --no-install-recommends \
        librbd1 librados2 libibverbs1 librdmacm1 ibverbs-providers libssl3 ca-certificates; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log; \
    groupadd --system --gid 65532 nvmeof; \
    useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin nvmeof; \
    install -d -o 65532 -g 65532 -m 0755 /etc/nvmeof /etc/ceph

COPY --chown=0:0 target/release/nvmeof-gateway target/release/nvmeof-control target/release/nvmeofctl /usr/bin/

# Every library of every binary resolves in this layer (a missing one fails the build).
RUN set -eu; \
    for b in /usr/bin/nvmeof-gateway /usr/bin/nvmeof-control /usr/bin/nvmeofctl; do \
        if ldd "$b" | grep -q 'not found'; then ldd "$b"; echo "$b: unresolved libraries" >&2; exit 1; fi; \
        "$b" --version; \
    done

# After the layers above, so that a new revision keeps their build cache.
ARG BASE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="nvmeof-gateway" \
      org.opencontainers.image.description="Ceph RBD to NVMe-oF (TCP, RDMA) gateway group: nvmeof-gateway, nvmeof-control, nvmeofctl" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE}"

# Runs as any UID; this is the default. A gateway that registers RDMA memory needs a memlock
# limit (CAP_IPC_LOCK), not root.
USER 65532:65532
WORKDIR /
# 4420 NVMe/TCP and NVMe/RDMA, 8009 discovery, 5500 control-plane gRPC, 10008 gateway metrics
# and health, 10010 control-plane metrics and health
EXPOSE 4420 8009 5500 10008 10010
# No entrypoint: the command names the binary (Kubernetes sets it; by hand,
# `docker run IMAGE nvmeofctl --server ...`).
CMD ["/usr/bin/nvmeof-gateway", "--help"]
