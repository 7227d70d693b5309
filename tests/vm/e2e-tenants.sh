#!/bin/bash
# e2e-tenants.sh - one gateway group shared by tenants, checked with the real Linux host.
# Runs on the HOST:
#
#   tests/vm/e2e-tenants.sh [BIN_DIR]      (default: target/release)
#
# The group is tests/vm/e2e-group.sh's (a micro Ceph, two nvmeof-control replicas, gateways
# gw1 and gw2 owning ANA groups 1 and 2, its own subsystem and images), with
# tests/vm/e2e-tenants-guest.sh as the guest script instead of e2e-group's failover rounds:
# the guest runs one part per tests/vm/tenants/PART.sh (per-host visibility, QoS, group
# reservations, the ceph-nvmeof API...), each on its own subsystem, as one VM boot.
#
# Env: E2E_TENANT_PARTS (comma-separated part names, default every tests/vm/tenants/*.sh),
#      E2E_LOG_DIR (logs in $E2E_LOG_DIR/e2e-tenants), E2E_TIMEOUT (VM hard timeout, default
#      900 s), and e2e-group.sh's other knobs.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export E2E_GUEST=$ROOT/tests/vm/e2e-tenants-guest.sh E2E_NAME=e2e-tenants
export E2E_GATEWAYS=${E2E_GATEWAYS:-2} E2E_ROUNDS=0
export E2E_TENANT_PARTS=${E2E_TENANT_PARTS:-} E2E_GUEST_ENV=E2E_TENANT_PARTS
exec "$ROOT/tests/vm/e2e-group.sh" "$@"
