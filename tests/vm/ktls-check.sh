#!/usr/bin/env bash
# ktls-check.sh - the gateway's TLS integration tests (gateway/tests/tls.rs) in a guest whose
# kernel has the `tls` module, so that secure NVMe/TCP connections are served by kernel TLS
# (the keys on the socket) and not by the user-space relay the gateway falls back to on a
# kernel without it (like the build machine's: TCP_ULP "tls" fails there with ENOENT).
#
# On the host (builds the test binary and the gateway, fetches/reuses the backports kernel,
# boots it; Debian bookworm's own 6.1 has CONFIG_TLS=m too, the backports 6.12 is what the
# other VM tests boot):
#
#   tests/vm/ktls-check.sh                 # = build, then run-in-vm.sh ... ktls-check.sh --guest BIN
#
# In the guest (--guest BIN): modprobe tls, check that "tls" is an available TCP ULP, then run
# BIN (the tls test binary) with NVMEOF_TEST_KTLS=required: every secure connection of the
# test `secure_queues_carry_data_by_kernel_tls_or_the_relay` must be counted by
# nvmeof_tls_ktls_connections_total and none by nvmeof_tls_relay_connections_total, while
# writes and reads of 512 B to 1 MiB (and 4 KiB reads at QD8), both cipher suites, come back
# byte for byte, busy polling (always on there) reads from the kernel TLS sockets, and the
# host's close_notify closes each queue; the other tests of the binary (handshake refusals,
# DH-HMAC-CHAP over TLS, a group gateway) run over kernel TLS too. Prints PASS/FAIL; exit
# status 0 only if all passed.
#
#   tests/vm/ktls-check.sh --bench [--relay] [BENCH ARGS]   # e.g. --seconds 3 --rounds 3
#
# runs the tcp_loopback bench's --tls mode in the guest instead (built with cargo bench
# --no-run; `--guest-bench BIN ARGS` in the guest), where the gateway serves TLS by kernel TLS:
# its plain, host-relay and TLS rows are the kTLS counterpart of the same run on a host
# without the tls module (the fallback relay). Under TCG (no KVM) every figure is an
# emulated CPU's: compare the ratios within one run, not the IOPS with the host's.
# --relay: the same guest with module loading turned off (/proc/sys/kernel/modprobe =
# /bin/false, tls not loaded), so the gateway falls back to its relay: the like-for-like
# comparison of kernel TLS and the relay on the same emulated CPU.
#
# Env: KTLS_VM_TIMEOUT (default 600 s); run-in-vm.sh's VM_* settings (VM_ACCEL=kvm where nested KVM works).
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

if [ "${1:-}" = --guest ]; then
    bin=${2:?usage: ktls-check.sh --guest TEST_BINARY}
    modprobe tls
    grep -qw tls /proc/sys/net/ipv4/tcp_available_ulp \
        || { echo "FAIL kernel.tls: no tls in tcp_available_ulp after modprobe"; exit 1; }
    echo "PASS kernel.tls: $(uname -r), ULPs: $(cat /proc/sys/net/ipv4/tcp_available_ulp)"
    cd /tmp
    if NVMEOF_TEST_KTLS=required "$bin" --test-threads 1 --nocapture; then
        echo "PASS tls-tests: gateway/tests/tls.rs with NVMEOF_TEST_KTLS=required"
    else
        echo "FAIL tls-tests: gateway/tests/tls.rs with NVMEOF_TEST_KTLS=required"
        exit 1
    fi
    exit 0
fi

if [ "${1:-}" = --guest-bench ]; then
    bin=${2:?usage: ktls-check.sh --guest-bench BENCH_BINARY [ARGS]}
    shift 2
    if [ "${1:-}" = --relay ]; then
        shift
        echo /bin/false > /proc/sys/kernel/modprobe
    else
        modprobe tls
    fi
    cd /tmp
    exec "$bin" --bench --tls "$@"
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
if [ "${1:-}" = --bench ]; then
    shift
    bench=$(cargo bench -p nvmeof-gateway --bench tcp_loopback --no-run --message-format=json 2>/dev/null \
        | grep '"kind":\["bench"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    [ -x "$bench" ] || { echo "ktls-check: no bench binary built" >&2; exit 1; }
    eval "$("$HERE/get-bpo-kernel.sh")"
    exec "$HERE/run-in-vm.sh" -t "${KTLS_VM_TIMEOUT:-600}" -w "$ROOT/target" \
        "$HERE/ktls-check.sh" --guest-bench "$bench" "$@"
fi
# The test binary's path, from cargo's own report (the hash in its name changes).
bin=$(cargo test -p nvmeof-gateway --test tls --no-run --message-format=json 2>/dev/null \
    | grep '"kind":\["test"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "ktls-check: no test binary built" >&2; exit 1; }
cargo build -p nvmeof-gateway --bin nvmeof-gateway
eval "$("$HERE/get-bpo-kernel.sh")"
exec "$HERE/run-in-vm.sh" -t "${KTLS_VM_TIMEOUT:-600}" -w "$ROOT/target" \
    "$HERE/ktls-check.sh" --guest "$bin"
