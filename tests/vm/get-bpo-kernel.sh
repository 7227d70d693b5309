#!/usr/bin/env bash
# get-bpo-kernel.sh - fetch and unpack (NOT install) Debian's bookworm-backports kernel for
# run-in-vm.sh. bookworm's own 6.1 has no NVMe in-band authentication; the backports kernel
# (6.12) has CONFIG_NVME_HOST_AUTH and CONFIG_NVME_TARGET_AUTH (e2e-auth.sh needs both).
#
# usage: tests/vm/get-bpo-kernel.sh [-f] [DIR]
#   DIR  cache dir (default $BPO_KERNEL_DIR, else ${XDG_CACHE_HOME:-~/.cache}/run-in-vm/bpo-kernel).
#        A kernel already unpacked there is reused: no network, no root needed.
#   -f   fetch again (the newest backports kernel), replacing the cached one.
# Prints (stdout, nothing else) the settings run-in-vm.sh takes for an unpacked kernel:
#   export VM_KERNEL=DIR/root/boot/vmlinuz-VER VM_MODDIR=DIR/root/lib/modules/VER
# e.g.  eval "$(tests/vm/get-bpo-kernel.sh)" && tests/vm/run-in-vm.sh tests/vm/e2e-auth.sh --kernel-target
#
# How: apt-get with a private state dir (lists, cache and sources under DIR/apt, removed
# afterwards), so the system's apt sources and package database stay as they are. The mirror
# is the one of the system's Debian sources (/etc/apt/sources.list.d/*.sources or
# /etc/apt/sources.list; $BPO_MIRROR overrides), the suite bookworm-backports, checked
# against debian-archive-keyring. The package is the one linux-image-amd64/bookworm-backports
# depends on; dpkg-deb -x unpacks it and depmod -b indexes its modules. Needs apt-get,
# dpkg-deb and depmod (kmod), and root for the fetch. ~110 MB download, ~120 MB unpacked,
# 15-60 s depending on the mirror.
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"  # depmod
die() { echo "get-bpo-kernel: $*" >&2; exit 1; }
log() { echo "get-bpo-kernel: $*" >&2; }

FORCE=0
if [ "${1:-}" = -f ]; then FORCE=1; shift; fi
case ${1:-} in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;; -*) die "unknown option $1 (-h for help)" ;; esac
DIR=${1:-${BPO_KERNEL_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/run-in-vm/bpo-kernel}}
mkdir -p "$DIR" || die "cannot create $DIR"
DIR=$(cd "$DIR" && pwd)

cached() { # the cached env file, if what it names is all there
  local VM_KERNEL="" VM_MODDIR=""
  [ -s "$DIR/env" ] || return 1
  # shellcheck disable=SC1091
  eval "$(sed 's/^export //' "$DIR/env")" 2>/dev/null || return 1
  [ -r "$VM_KERNEL" ] && [ -s "$VM_MODDIR/modules.dep" ]
}

# one fetch at a time per cache dir (a second caller waits, then reuses the result)
exec 9> "$DIR/.lock"
flock -w 900 9 || die "timed out waiting for another get-bpo-kernel.sh on $DIR"
if [ $FORCE = 0 ] && cached; then cat "$DIR/env"; exit 0; fi

for t in apt-get apt-cache dpkg-deb depmod; do
  command -v $t >/dev/null || die "$t not found (Debian: apt-get install apt dpkg kmod)"
done

# ---- a private apt state for bookworm-backports (tests/vm/debian-apt.sh) ---------------
. "$(dirname "${BASH_SOURCE[0]}")/debian-apt.sh"
A=$DIR/apt
trap 'rm -rf "$A" "$DIR/root.new"' EXIT
apt_private "$A" bookworm-backports || die "no bookworm-backports package lists (see above)"
PKG=$(apt-cache "${APTO[@]}" depends linux-image-amd64/bookworm-backports 2>/dev/null |
      awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$PKG" ] || die "linux-image-amd64/bookworm-backports names no kernel package"
log "downloading $PKG/bookworm-backports"
(cd "$A/pkgs" && apt-get -q "${APTO[@]}" download "$PKG/bookworm-backports" >&2) || die "apt-get download $PKG failed"
DEB=$(ls "$A/pkgs/${PKG}"_*.deb 2>/dev/null | head -n 1)
[ -n "$DEB" ] || die "no .deb for $PKG downloaded"

rm -rf "$DIR/root.new"
mkdir -p "$DIR/root.new"
dpkg-deb -x "$DEB" "$DIR/root.new" || die "dpkg-deb -x $DEB failed"
KVER=$(ls "$DIR/root.new/lib/modules" | head -n 1)
[ -n "$KVER" ] && [ -r "$DIR/root.new/boot/vmlinuz-$KVER" ] || die "$DEB has no /boot/vmlinuz-<ver> with /lib/modules/<ver>"
depmod -b "$DIR/root.new" "$KVER" || die "depmod -b $DIR/root.new $KVER failed"
# a kernel without NVMe auth would only fail later, inside the VM
grep -qE '^CONFIG_NVME_(HOST_)?AUTH=y' "$DIR/root.new/boot/config-$KVER" &&
  grep -q '^CONFIG_NVME_TARGET_AUTH=y' "$DIR/root.new/boot/config-$KVER" ||
  die "$PKG lacks CONFIG_NVME_HOST_AUTH / CONFIG_NVME_TARGET_AUTH"
rm -rf "$DIR/root" "$DIR/env"
mv "$DIR/root.new" "$DIR/root"
printf 'export VM_KERNEL=%q VM_MODDIR=%q\n' "$DIR/root/boot/vmlinuz-$KVER" "$DIR/root/lib/modules/$KVER" > "$DIR/env.new"
mv "$DIR/env.new" "$DIR/env"
log "unpacked $PKG ($KVER, $(du -sm "$DIR/root" | cut -f1) MB)"
cat "$DIR/env"
