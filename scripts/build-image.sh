#!/usr/bin/env bash
# build-image.sh - build the nvmeof-gateway container image (one command; see
# docs/container-image.md).
#
#   scripts/build-image.sh [--no-cargo] [--no-strip] [--image NAME] [--base TAG] [--rebuild-base]
#
#   1. cargo build --release -p nvmeof-gateway -p control-plane --bins   (skipped with --no-cargo:
#      the binaries in $CARGO_TARGET_DIR/release, default target/release, are used as they are)
#   2. dockerd started in the background when no daemon answers (root; its log in
#      target/dockerd.log, its PID in target/dockerd.pid; it keeps running afterwards)
#   3. the base image BASE (default nvmeof-base/debian:bookworm-minbase), made locally when
#      missing: debootstrap --variant=minbase bookworm into a temporary directory, docs/man
#      pages/locales dropped, `tar -C DIR -c . | docker import - BASE`. The tarball is cached in
#      ~/.cache/nvmeof-image/ (NVMEOF_IMAGE_CACHE), so a fresh dockerd imports it again in seconds.
#      --rebuild-base makes it again (e.g. for Debian's security updates).
#   4. docker build of the repository's Dockerfile with a build context holding only the three
#      binaries (debug info stripped unless --no-strip; symbols stay, so panics still name
#      functions), apt reaching Debian's mirror through the host's network (--network host),
#      tagged NAME:<workspace version> and NAME:latest (NAME default nvmeof-gateway)
#   5. prints the image's size and labels.
#
# Idempotent: with the base present and the binaries unchanged, everything is cached (~5 s).
# Env: DOCKER (client, default docker), NVMEOF_IMAGE_SOURCE (the org.opencontainers.image.source
#      label, default the git remote origin's URL), DEBIAN_MIRROR (default http://deb.debian.org/debian),
#      CARGO_TARGET_DIR, CARGO_BUILD_JOBS.
# Needs: docker.io, debootstrap (apt-get install docker.io debootstrap), root for dockerd and
#      debootstrap. Exit 0 once the image is tagged.
set -euo pipefail
export LC_ALL=C
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PATH="$HOME/.cargo/bin:$PATH:/usr/local/sbin:/usr/sbin:/sbin"

die() { echo "build-image: $*" >&2; exit 1; }
say() { echo "build-image: $*"; }

CARGO=1 STRIP=1 REBUILD_BASE=0
IMAGE=nvmeof-gateway
BASE=nvmeof-base/debian:bookworm-minbase
while [ $# -gt 0 ]; do
  case $1 in
    --no-cargo) CARGO=0; shift ;;
    --no-strip) STRIP=0; shift ;;
    --image) IMAGE=${2:?--image needs a name}; shift 2 ;;
    --base) BASE=${2:?--base needs a tag}; shift 2 ;;
    --rebuild-base) REBUILD_BASE=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) die "unknown option $1 (-h for help)" ;;
  esac
done

DOCKER=${DOCKER:-docker}
# The classic builder: the daemon of Debian's docker.io builds with it without the buildx
# plugin, and it never tries to fetch a Dockerfile frontend image from a registry.
export DOCKER_BUILDKIT=0
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
case $TARGET_DIR in /*) ;; *) TARGET_DIR=$ROOT/$TARGET_DIR ;; esac
CACHE=${NVMEOF_IMAGE_CACHE:-$HOME/.cache/nvmeof-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BINS=(nvmeof-gateway nvmeof-control nvmeofctl)
VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[ -n "$VERSION" ] || die "no [workspace.package] version in Cargo.toml"
T0=$(date +%s)

# ---------------------------------------------------------------- binaries --
if [ $CARGO = 1 ]; then
  say "cargo build --release -p nvmeof-gateway -p control-plane --bins"
  cargo build --release -p nvmeof-gateway -p control-plane --bins
fi
for b in "${BINS[@]}"; do
  [ -x "$TARGET_DIR/release/$b" ] || die "$TARGET_DIR/release/$b missing (run without --no-cargo)"
done

# ----------------------------------------------------------------- dockerd --
docker_up() { "$DOCKER" info >/dev/null 2>&1; }
if ! docker_up; then
  command -v dockerd >/dev/null || die "dockerd not found: apt-get install docker.io"
  [ "$(id -u)" = 0 ] || die "no docker daemon answers and starting one needs root"
  mkdir -p "$TARGET_DIR"
  say "starting dockerd (log $TARGET_DIR/dockerd.log)"
  # setsid: not in this script's process group, so it outlives the script and a ^C of it
  setsid dockerd >>"$TARGET_DIR/dockerd.log" 2>&1 </dev/null &
  echo $! >"$TARGET_DIR/dockerd.pid"
  for _ in $(seq 600); do docker_up && break; kill -0 "$(cat "$TARGET_DIR/dockerd.pid")" 2>/dev/null || break; sleep 0.1; done
  docker_up || { tail -n 20 "$TARGET_DIR/dockerd.log" >&2; die "dockerd did not come up"; }
  say "dockerd pid $(cat "$TARGET_DIR/dockerd.pid") is up ($("$DOCKER" version -f '{{.Server.Version}}' 2>/dev/null))"
fi

# -------------------------------------------------------------------- base --
make_base_tar() { # TAR: debootstrap a minbase bookworm, trimmed, into TAR
  local tar=$1 dir
  command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install debootstrap"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  dir=$(mktemp -d "${TMPDIR:-/tmp}/nvmeof-base.XXXXXX")
  # shellcheck disable=SC2064  # expand dir now
  trap "rm -rf '$dir'" EXIT
  say "debootstrap --variant=minbase bookworm $dir $MIRROR (once; cached in $CACHE)"
  debootstrap --variant=minbase bookworm "$dir" "$MIRROR" >"$dir.log" 2>&1 ||
    { tail -n 20 "$dir.log" >&2; die "debootstrap failed (log $dir.log)"; }
  rm -f "$dir.log"
  cat >"$dir/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${MIRROR%/debian}/debian-security bookworm-security main
EOF
  # as Debian's container images do: no docs, man pages or translations in later layers
  # either, and apt keeps no package files
  cat >"$dir/etc/dpkg/dpkg.cfg.d/excludes" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  cat >"$dir/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  echo 'Acquire::Languages "none";' >"$dir/etc/apt/apt.conf.d/docker-no-languages"
  find "$dir/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$dir/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/usr/share/locale/* \
    "$dir"/var/cache/apt/archives/*.deb "$dir"/var/cache/apt/*.bin "$dir"/var/lib/apt/lists/* \
    "$dir"/var/log/* "$dir"/tmp/* "$dir/etc/hostname" "$dir/etc/resolv.conf"
  : >"$dir/etc/machine-id"
  mkdir -p "$CACHE"
  tar --numeric-owner -C "$dir" -cf "$tar.tmp" . && mv "$tar.tmp" "$tar"
  rm -rf "$dir"; trap - EXIT
}
if [ $REBUILD_BASE = 1 ] || ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  tar=$CACHE/$(echo "$BASE" | tr '/:' '__').tar
  if [ $REBUILD_BASE = 1 ] || [ ! -s "$tar" ]; then make_base_tar "$tar"; fi
  say "docker import $tar $BASE"
  "$DOCKER" import --change 'CMD ["/bin/bash"]' - "$BASE" <"$tar" >/dev/null
fi
say "base $BASE: $(( $("$DOCKER" image inspect -f '{{.Size}}' "$BASE") / 1000000 )) MB"

# ------------------------------------------------------------------- build --
CTX=$TARGET_DIR/image-context
rm -rf "$CTX"
mkdir -p "$CTX/target/release"
for b in "${BINS[@]}"; do
  if [ $STRIP = 1 ]; then objcopy --strip-debug "$TARGET_DIR/release/$b" "$CTX/target/release/$b"
  else cp "$TARGET_DIR/release/$b" "$CTX/target/release/$b"; fi
  # the same mtime for the same content: docker's build cache then keeps the COPY layer
  touch -r "$TARGET_DIR/release/$b" "$CTX/target/release/$b"
done
cp .dockerignore "$CTX/.dockerignore"
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || REVISION=$REVISION-dirty
CREATED=$(git log -1 --format=%cI 2>/dev/null || date -u +%FT%TZ)
SOURCE=${NVMEOF_IMAGE_SOURCE:-$(git config --get remote.origin.url 2>/dev/null || echo unknown)}
say "docker build -t $IMAGE:$VERSION -t $IMAGE:latest (base $BASE, revision $REVISION)"
"$DOCKER" build --network host -f Dockerfile \
  --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" --build-arg REVISION="$REVISION" \
  --build-arg SOURCE="$SOURCE" --build-arg CREATED="$CREATED" \
  -t "$IMAGE:$VERSION" -t "$IMAGE:latest" "$CTX"
rm -rf "$CTX"

size=$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE:$VERSION")
bsize=$("$DOCKER" image inspect -f '{{.Size}}' "$BASE")
say "labels: $("$DOCKER" image inspect -f '{{range $k, $v := .Config.Labels}}{{$k}}={{$v}} {{end}}' "$IMAGE:$VERSION")"
say "IMAGE SIZE $IMAGE:$VERSION: $((size / 1000000)) MB ($size bytes; base $((bsize / 1000000)) MB, runtime libraries and binaries $(((size - bsize) / 1000000)) MB), built in $(($(date +%s) - T0))s"
