#!/usr/bin/env bash
# Runs the rbd-backend tests that need a real Ceph cluster (tests/ceph.rs): starts a throwaway
# micro cluster in its own directory (packages are apt-installed when missing and root),
# runs the tests, stops the cluster whatever happened. Exit code = cargo's.
#
#   bash rbd-backend/tests/ceph-tests.sh [extra cargo test args, e.g. -- --nocapture]
#
# Env: MICRO_CEPH_STORE (memstore|bluestore, default memstore), CARGO (default cargo).
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
"${CARGO:-cargo}" test -p rbd-backend --features ceph-tests --test ceph "$@"
