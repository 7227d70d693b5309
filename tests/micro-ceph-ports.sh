#!/usr/bin/env bash
# tests/micro-ceph-ports.sh - scripts/micro-ceph.sh when the mon's port is taken.
#
# A port is held by a listener of our own. Then:
#   1. a start whose first attempt gets that port (MICRO_CEPH_FIRST_PORT) starts on another
#      port and says so, and the cluster answers;
#   2. a start told to use that port (--port) fails with exit 75 and leaves no daemon and no
#      directory behind.
# Run by rbd-backend/tests/ceph-tests.sh (stage ceph). Exit 0 only if both hold.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mc=$root/scripts/micro-ceph.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/micro-ceph-ports.XXXXXX")
holder=""
cleanup() {
  "$mc" stop "$work/retry" >/dev/null 2>&1
  "$mc" stop "$work/fixed" >/dev/null 2>&1
  [ -z "$holder" ] || kill "$holder" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

failed=0
check() { # check DESCRIPTION COMMAND...
  if "${@:2}"; then echo "ok   $1"; else echo "FAIL $1"; failed=1; fi
}
# processes started with DIR's ceph.conf in their environment (micro-ceph exports
# CEPH_CONF for its daemons; a zombie's environment reads empty)
processes_of() { grep -lsF "CEPH_CONF=$1/ceph.conf" /proc/[0-9]*/environ; }

# the holder listens until it is killed; it prints its port once listening
python3 -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(3600)' > "$work/port" &
holder=$!
for _ in $(seq 50); do [ -s "$work/port" ] && break; sleep 0.1; done
taken=$(cat "$work/port")
[ -n "$taken" ] || { echo "FAIL the holder did not listen"; exit 1; }
echo "port $taken is held by pid $holder"

# 1. retry on a fresh port
rc=0
MICRO_CEPH_FIRST_PORT=$taken "$mc" start --dir "$work/retry" --image '' --no-mgr \
  > "$work/retry.env" 2> "$work/retry.err" || rc=$?
check "a start whose first port is taken exits 0 (rc $rc)" [ "$rc" = 0 ]
check "it says it starts again on another port" grep -q 'starting again on another' "$work/retry.err"
port=$(sed -n 's/^mon_host = \[v2:127.0.0.1:\([0-9]*\),.*/\1/p' "$work/retry/ceph.conf" 2>/dev/null)
check "the cluster's mon is on another port ($port, not $taken)" [ -n "$port" ] && [ "$port" != "$taken" ]
check "the cluster answers" bash -c "eval \"\$(cat '$work/retry.env')\" && timeout 60 ceph health >/dev/null"
# proves that the check of 2. below would see daemons left behind
check "its daemons are found by their environment" [ -n "$(processes_of "$work/retry")" ]

# 2. --port on the taken port: a clear failure, nothing left behind
rc=0
"$mc" start --dir "$work/fixed" --port "$taken" --image '' --no-mgr > /dev/null 2> "$work/fixed.err" || rc=$?
check "a start told to use the taken port exits 75 (rc $rc)" [ "$rc" = 75 ]
check "it names the port" grep -q "could not bind 127.0.0.1:$taken" "$work/fixed.err"
check "it leaves no directory" [ ! -e "$work/fixed" ]
check "it leaves no daemon running" [ -z "$(processes_of "$work/fixed")" ]

[ $failed = 0 ] || { echo "stderr of the retried start:"; sed 's/^/  | /' "$work/retry.err" | tail -n 30; }
exit $failed
