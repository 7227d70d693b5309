#!/usr/bin/env bash
# Runs the tests that need a real Ceph cluster: starts a throwaway micro cluster in its own
# directory (Ceph packages are apt-installed when missing and root), runs
#   - rbd-backend/tests/ceph.rs   (RbdDevice against the cluster; feature ceph-tests)
#   - rbd-backend/tests/rados.rs  (omap compare-and-set, lock leases, watch/notify, blocklist)
#   - gateway/tests/rbd_e2e.rs    (gateway + Rust NVMe/TCP host, checked with rbd export;
#                                  #[ignore]d in plain cargo test, run here with --ignored)
#   - control-plane/tests/rados_store.rs (group state in RADOS, watch refresh, leader lease)
#   - control-plane/tests/replicas.rs    (kill -9 the leading nvmeof-control; failover after)
#   - gateway/tests/failover.rs   (two gateway processes + control plane: fenced failover)
#   - gateway/tests/failover_kill.rs   (kill -9 of a gateway: fenced and moved at once, no grace)
#   - gateway/tests/group_config.rs (subsystems/namespaces pushed from the control plane)
#   - gateway/tests/group_auto_resize.rs (auto-resize off: rbd resize and a restart keep the
#                                  size the host sees; namespace resize changes it)
#   - gateway/tests/osd_down_start.rs (gateway start with the OSD stopped: serves, RBD later)
#   - gateway/tests/osd_stall_budget.rs (hosts writing into a stopped OSD: the data budget
#                                  bounds the buffers, every write lands once it resumes)
#   - gateway/tests/osd_unanswered.rs (a group gateway's commands at a stopped OSD while the
#                                  monitors answer: the OSD probe names it, metric and log)
#   - gateway/tests/fenced_group.rs (one ANA group's client blocklisted: only it stops)
#   - gateway/tests/group_reservations.rs (reservations stored by the ANA owner, loaded by
#                                  the next one: kill -9 of the owner and failback keep them)
#   - gateway/tests/group_removals.rs (namespace/host/subsystem del applied on a running gateway)
#   - gateway/tests/group_auth.rs (DH-HMAC-CHAP keys given with nvmeofctl, enforced by the
#                                  group's gateway; runs the nvmeofctl binary, built first)
#   - control-plane/tests/health.rs (nvmeof-control with its keyring missing: up, not ready,
#                                  then ready once the file appears)
#   - gateway/tests/health.rs     (a gateway whose keyring appears later turns ready)
#   - tests/micro-ceph-mgr.sh     (the cluster's ceph-mgr: available, rbd trash purge, a trash
#                                  remove task through rbd_support, as ceph-csi deletes)
#   - tests/micro-ceph-ports.sh   (micro-ceph.sh when the mon's port is taken: retry, or exit 75)
# and stops the cluster whatever happened. Exit code: non-zero if any test failed.
#
#   bash rbd-backend/tests/ceph-tests.sh [test binary args, e.g. --nocapture or a name filter]
#
# Env: MICRO_CEPH_STORE (memstore|bluestore, default memstore), CARGO (default cargo),
# CEPH_TEST_TIMEOUT (seconds per test binary, default 900).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/rbd-tests-ceph.XXXXXX")
rmdir "$dir" # micro-ceph creates it
cleanup() { "$root/scripts/micro-ceph.sh" stop "$dir" >/dev/null 2>&1 || true; }
trap cleanup EXIT
env_lines=$("$root/scripts/micro-ceph.sh" start --dir "$dir" --store "${MICRO_CEPH_STORE:-memstore}" --image '')
eval "$env_lines"
echo "ceph-tests: cluster in $MICRO_CEPH_DIR (conf $CEPH_CONF)" >&2
cd "$root"
export MICRO_CEPH_FAULT_TESTS=${MICRO_CEPH_FAULT_TESTS:-1}
rc=0
# Each test binary gets at most CEPH_TEST_TIMEOUT seconds (default 900, compiling included):
# an op the cluster never answers (say, a full OSD dropping writes) would otherwise hang
# the stage until CI's own limit, with nothing said about why.
bounded() {
  local status
  timeout -k 10 "${CEPH_TEST_TIMEOUT:-900}" "$@"
  status=$?
  if [ $status -eq 124 ]; then
    echo "ceph-tests: TIMEOUT after ${CEPH_TEST_TIMEOUT:-900} s: $*; the cluster says:" >&2
    timeout 20 ceph health detail >&2 || true
  fi
  # A fault test killed here (timeout) while it held the OSD stopped (SIGSTOP) never ran its
  # resume: every later test would hang on the cluster. SIGCONT to a running OSD is a no-op.
  awk '$2 == "osd.0" {print $1}' "$MICRO_CEPH_DIR/pids" | xargs -r kill -CONT 2>/dev/null || true
  return $status
}
bounded "${CARGO:-cargo}" test -p rbd-backend --features ceph-tests --test ceph -- "$@" || rc=1
bounded "${CARGO:-cargo}" test -p rbd-backend --features ceph-tests --test rados -- "$@" || rc=1
bounded "${CARGO:-cargo}" test -p control-plane --features ceph-tests --test rados_store -- "$@" || rc=1
bounded "${CARGO:-cargo}" test -p control-plane --features ceph-tests --test replicas -- "$@" || rc=1
bounded "${CARGO:-cargo}" test -p control-plane --features ceph-tests --test health -- "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test rbd_e2e -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test failover -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test failover_kill -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test group_config -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test group_auto_resize -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test osd_down_start -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test osd_stall_budget -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test osd_unanswered -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test fenced_group -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test group_reservations -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test group_removals -- --ignored "$@" || rc=1
bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test health -- --ignored "$@" || rc=1
{ bounded "${CARGO:-cargo}" build -p control-plane --bin nvmeofctl &&
  bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test group_auth -- --ignored "$@"; } || rc=1
{ bounded "${CARGO:-cargo}" build -p control-plane --bin nvmeofctl &&
  bounded "${CARGO:-cargo}" test -p nvmeof-gateway --test group_io_stats_ceph -- --ignored "$@"; } || rc=1
bash "$root/tests/micro-ceph-mgr.sh" || rc=1
bash "$root/tests/micro-ceph-ports.sh" || rc=1
exit $rc
