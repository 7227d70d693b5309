#!/usr/bin/env bash
# install-deps.sh - Debian 12 packages needed by tests/vm/run-in-vm.sh and the
# in-guest tests (e2e-tcp.sh, kernel-target-check.sh).
# Idempotent: exits at once when everything is installed. ~50 s and ~120 MB
# download on a fresh machine. Needs root (or passwordless sudo) only when
# something is missing. Set SKIP_APT_UPDATE=1 if 'apt-get update' already ran.
set -euo pipefail
PKGS=(
  qemu-system-x86   # TCG emulator (7.2 in bookworm)
  linux-image-amd64 # guest kernel 6.1 + modules: nvme-tcp, nvmet(-tcp), null_blk
  busybox-static    # initramfs userland (static)
  cpio kmod         # building the initramfs, resolving module dependencies
  nvme-cli fio      # initiator tooling + I/O verification
  e2fsprogs iproute2 python3
  rdma-core ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils  # Soft-RoCE (rxe) for e2e-rdma.sh
  docker.io debootstrap python3-venv  # e2e-k8s: the container image (scripts/build-image.sh) and the Helm venv
  libssl-dev pkg-config  # building the gateway: it links OpenSSL for NVMe/TCP TLS (openssl-sys)
)
need=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -eq 0 ]; then echo "install-deps: all present"; exit 0; fi
echo "install-deps: installing ${need[*]}"
SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=(sudo -n)
  else echo "install-deps: missing packages (${need[*]}) and not root: run as root" >&2; exit 1; fi
fi
# Never run concurrently with another apt/dpkg: wait for the dpkg lock (up to 10 min).
LOCKWAIT=(-o DPkg::Lock::Timeout=600)
[ "${SKIP_APT_UPDATE:-0}" = 1 ] || "${SUDO[@]}" apt-get "${LOCKWAIT[@]}" update -qq
extra=()
# Some images ship qemu-utils 8+/10.x from bookworm-backports, which Breaks
# qemu-system-common << 8.0: move qemu-utils to bookworm's 7.2 as well.
if dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null | grep -q '^1:\(8\|9\|1[0-9]\)\.'; then
  extra=(--allow-downgrades qemu-utils/bookworm)
fi
# INITRD=No: skip building /boot/initrd.img (30+ MB, ~20 s); run-in-vm.sh
# builds its own tiny initramfs.
"${SUDO[@]}" env INITRD=No DEBIAN_FRONTEND=noninteractive apt-get "${LOCKWAIT[@]}" install -y -qq \
  --no-install-recommends "${need[@]}" "${extra[@]}"
echo "install-deps: done"
