#!/usr/bin/env bash
# tests/micro-ceph-mgr.sh - the micro Ceph's manager (scripts/micro-ceph.sh starts one): what
# ceph-csi's DeleteVolume and a user's `rbd trash` need of it. Runs against the cluster of
# the environment (CEPH_CONF, as `eval "$(scripts/micro-ceph.sh start)"` sets it; the ceph
# stage's cluster in rbd-backend/tests/ceph-tests.sh):
#   1. `ceph mgr stat` says available
#   2. `rbd trash purge` empties the pool's trash
#   3. ceph-csi's delete: an image moved to the trash, then `ceph rbd task add trash remove`
#      (the mgr's rbd_support module) returns, and the image leaves the trash within 30 s
# Last line: "N passed, N failed".
set -u
[ -n "${CEPH_CONF:-}" ] || { echo "CEPH_CONF is not set (eval \"\$(scripts/micro-ceph.sh start)\")"; echo "0 passed, 1 failed"; exit 1; }
pool=${MICRO_CEPH_POOL:-rbd}
passed=0 failed=0
check() { # description command...
  local what=$1; shift
  if "$@"; then echo "PASS $what"; passed=$((passed + 1)); else echo "FAIL $what"; failed=$((failed + 1)); fi
}
tag=mgr-check-$$-$RANDOM

mgr_available() { timeout 30 ceph mgr stat --format json | grep -q '"available": *true'; }
trash_count() { timeout 30 rbd trash ls "$pool" | wc -l; }
purge() {
  timeout 60 rbd create --size 8M "$pool/$tag-a" && timeout 60 rbd trash mv "$pool/$tag-a" || return 1
  [ "$(trash_count)" -ge 1 ] || { echo "  the image is not in the trash"; return 1; }
  timeout 60 rbd trash purge "$pool" 2>&1 | tail -n 1 | sed 's/^/  /'
  [ "$(trash_count)" = 0 ] || { echo "  the trash still holds $(trash_count) image(s)"; return 1; }
}
task_remove() {
  local id t0 out
  timeout 60 rbd create --size 8M "$pool/$tag-b" || return 1
  id=$(timeout 60 rbd info "$pool/$tag-b" --format json | python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])') || return 1
  timeout 60 rbd trash mv "$pool/$tag-b" || return 1
  t0=${EPOCHREALTIME/./}
  # without a mgr this never returns: bounded
  out=$(timeout 60 ceph rbd task add trash remove "$pool/$id" 2>&1) || { echo "  ceph rbd task add trash remove: $out"; return 1; }
  echo "  $out"
  for _ in $(seq 300); do
    timeout 30 rbd trash ls "$pool" | grep -q "^$id " || { echo "  image $id left the trash after $(( (${EPOCHREALTIME/./} - t0) / 1000 )) ms"; return 0; }
    sleep 0.1
  done
  echo "  image $id still in the trash after 30 s"; return 1
}

check "ceph mgr stat: available" mgr_available
check "rbd trash purge empties the trash" purge
check "an image in the trash is removed by the mgr's task (ceph rbd task add trash remove)" task_remove
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
