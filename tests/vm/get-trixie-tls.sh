#!/usr/bin/env bash
# get-trixie-tls.sh - fetch and unpack (NOT install) Debian trixie's tlshd (ktls-utils) and
# nvme-cli for the NVMe/TCP TLS test (e2e-tls.sh). bookworm has no tlshd, and its nvme-cli
# (2.4) cannot connect with TLS; trixie's nvme-cli 2.13 and tlshd 1.0 can, with the
# bookworm-backports kernel (6.12: CONFIG_NVME_TCP_TLS, CONFIG_NET_HANDSHAKE).
#
# usage: tests/vm/get-trixie-tls.sh [-f] [DIR]
#   DIR  cache dir (default $TLS_TOOLS_DIR, else ${XDG_CACHE_HOME:-~/.cache}/run-in-vm/trixie-tls).
#        Tools already unpacked there are reused: no network, no root needed.
#   -f   fetch again, replacing the cached ones.
# Prints (stdout, nothing else): export TLS_TOOLS=DIR/root
#
# How: apt-get on a private state dir (tests/vm/debian-apt.sh) downloads ktls-utils and
# nvme-cli from trixie with their whole dependency closure (trixie's libc6 among them: the
# binaries need glibc 2.38+), and dpkg-deb -x unpacks every package into DIR/root. Nothing
# there is installed or configured: the test runs the binaries through trixie's own dynamic
# loader, DIR/root/usr/lib64/ld-linux-x86-64.so.2 --library-path DIR/root/usr/lib/x86_64-linux-gnu
# (e2e-tls.sh's trixie function), so they never mix with bookworm's libraries. ~25 MB
# download, ~75 MB unpacked, a few seconds on a near mirror. Needs apt-get and dpkg-deb, and
# root for the fetch.
set -euo pipefail
die() { echo "get-trixie-tls: $*" >&2; exit 1; }
log() { echo "get-trixie-tls: $*" >&2; }

FORCE=0
if [ "${1:-}" = -f ]; then FORCE=1; shift; fi
case ${1:-} in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;; -*) die "unknown option $1 (-h for help)" ;; esac
DIR=${1:-${TLS_TOOLS_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/run-in-vm/trixie-tls}}
mkdir -p "$DIR" || die "cannot create $DIR"
DIR=$(cd "$DIR" && pwd)
PACKAGES=(ktls-utils nvme-cli)

# the unpacked root runs: both tools answer through trixie's loader
usable() { # root
  local ld=$1/usr/lib64/ld-linux-x86-64.so.2 lp=$1/usr/lib/x86_64-linux-gnu:$1/lib/x86_64-linux-gnu
  [ -x "$ld" ] && [ -x "$1/usr/sbin/tlshd" ] && [ -x "$1/usr/sbin/nvme" ] &&
    "$ld" --library-path "$lp" "$1/usr/sbin/nvme" version > /dev/null 2>&1 &&
    "$ld" --library-path "$lp" "$1/usr/sbin/tlshd" -h 2>&1 | grep -q 'usage: tlshd'
}

exec 9> "$DIR/.lock"
flock -w 900 9 || die "timed out waiting for another get-trixie-tls.sh on $DIR"
if [ $FORCE = 0 ] && [ -s "$DIR/env" ] && usable "$DIR/root"; then cat "$DIR/env"; exit 0; fi

for t in apt-get dpkg-deb; do
  command -v $t >/dev/null || die "$t not found (Debian: apt-get install apt dpkg)"
done
. "$(dirname "${BASH_SOURCE[0]}")/debian-apt.sh"
A=$DIR/apt
trap 'rm -rf "$A" "$DIR/root.new"' EXIT
apt_private "$A" trixie || die "no trixie package lists (see above)"
log "downloading ${PACKAGES[*]} from trixie with their dependencies"
apt-get -qq "${APTO[@]}" -o APT::Architecture=amd64 -o APT::Architectures::=amd64 \
  install --download-only -y --no-install-recommends "${PACKAGES[@]}" >&2 ||
  die "apt-get could not download ${PACKAGES[*]} from trixie"
rm -rf "$DIR/root.new"
mkdir -p "$DIR/root.new"
n=0
for deb in "$A"/cache/archives/*.deb; do
  dpkg-deb -x "$deb" "$DIR/root.new" || die "dpkg-deb -x $deb failed"
  n=$((n + 1))
done
usable "$DIR/root.new" || die "the unpacked tlshd / nvme do not run through trixie's loader"
rm -rf "$DIR/root" "$DIR/env"
mv "$DIR/root.new" "$DIR/root"
printf 'export TLS_TOOLS=%q\n' "$DIR/root" > "$DIR/env.new"
mv "$DIR/env.new" "$DIR/env"
log "unpacked $n packages ($(du -sm "$DIR/root" | cut -f1) MB): $(ls "$A"/cache/archives/ | grep -E '^(ktls-utils|nvme-cli)_' | tr '\n' ' ')"
cat "$DIR/env"
