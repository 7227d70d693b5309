#!/usr/bin/env bash
# tests/demo-start-loop.sh - scripts/demo.sh started and stopped N times in a row under a CPU
# load: every start must succeed (issue 26 item 1: demo.sh used to take a daemon that had not
# exec'd yet for one that exited, and stopped everything, about one start in six on a loaded
# machine).
#
#   tests/demo-start-loop.sh [N]        (default 30)
#
# Each round: `scripts/demo.sh` (start) must exit 0, `scripts/demo.sh status` must exit 0,
# `scripts/demo.sh stop` must exit 0. A failed round's demo.sh output and daemon logs are
# kept in $WORK/failed-R/ and the loop goes on. Last line: "N starts, F failed"; exit 0 only
# if none failed.
#
# Env: DEMO_BACKEND (rbd, the default: micro Ceph, control plane, two gateways; memory: one
#      gateway, no Ceph), DEMO_BIN (default target/release; needs nvmeof-gateway,
#      nvmeof-control, nvmeofctl: cargo build --release -p nvmeof-gateway -p control-plane),
#      LOAD (busy loops running during the whole loop; default: one per CPU; 0: none),
#      DEMO_SCRIPT (the demo.sh to start, default scripts/demo.sh: to measure another copy),
#      SLOW_EXEC (seconds, e.g. 0.3: each daemon is started through a wrapper that takes that
#      long to exec it, showing under another comm meanwhile: the window of a loaded
#      machine, made certain; the busy loops make it likely, this makes it happen every time),
#      KEEP_DIR (where failed rounds' logs go; default a temporary directory, removed when
#      nothing failed; the binaries' copies are removed in either case).
set -uo pipefail
export LC_ALL=C
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${1:-30}
BIN=${DEMO_BIN:-$ROOT/target/release}
case $BIN in /*) ;; *) BIN=$PWD/$BIN ;; esac
LOAD=${LOAD:-$(nproc)}
DEMO_SCRIPT=${DEMO_SCRIPT:-$ROOT/scripts/demo.sh}
BACKEND=${DEMO_BACKEND:-rbd}
SLOW_EXEC=${SLOW_EXEC:-}
. "$ROOT/tests/vm/requests.sh"  # port_unused, free_port

WORK=${KEEP_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/demo-start-loop.XXXXXX")}
mkdir -p "$WORK"
LOADERS=()
DEMO=$WORK/demo
cleanup() {
  local p
  for p in "${LOADERS[@]}"; do kill "$p" 2>/dev/null; done
  [ -d "$DEMO" ] && "${DEMO_CMD[@]}" stop >/dev/null 2>&1
  wait 2>/dev/null
  rm -rf "$WORK/bin"
  if [ "${FAILED:-1}" = 0 ] && [ -z "${KEEP_DIR:-}" ]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for b in nvmeof-gateway nvmeof-control nvmeofctl; do
  [ -x "$BIN/$b" ] || { echo "$BIN/$b missing (cargo build --release -p nvmeof-gateway -p control-plane)"; exit 2; }
done
# Private copies: a concurrent cargo build must not swap the binaries during the loop.
mkdir -p "$WORK/bin"
cp "$BIN"/nvmeof-gateway "$BIN"/nvmeof-control "$BIN"/nvmeofctl "$WORK/bin/"
if [ -n "$SLOW_EXEC" ]; then
  # Each daemon starts as a wrapper that is not the daemon yet for SLOW_EXEC seconds (its
  # comm is "starting", as a forked shell's or setsid's is before their exec), then execs it.
  mkdir -p "$WORK/bin/real"
  for b in nvmeof-gateway nvmeof-control; do
    mv "$WORK/bin/$b" "$WORK/bin/real/$b"
    printf '#!/bin/sh\nprintf starting > /proc/$$/comm\nsleep %s\nexec "%s" "$@"\n' \
      "$SLOW_EXEC" "$WORK/bin/real/$b" > "$WORK/bin/$b"
    chmod +x "$WORK/bin/$b"
  done
fi

# Ports: the gateways' pair, the control plane's, the metrics' three (demo.sh's layout).
PORT="" MPORT=""
for _ in $(seq 50); do p=$(free_port) && port_unused $((p + 1)) && { PORT=$p; break; }; done
CPORT=$(free_port "$PORT" $((PORT + 1)))
for _ in $(seq 50); do
  p=$(free_port "$PORT" $((PORT + 1)) "$CPORT") || continue
  case " $PORT $((PORT + 1)) $CPORT " in *" $((p + 1)) "* | *" $((p + 2)) "*) continue ;; esac
  port_unused $((p + 1)) && port_unused $((p + 2)) && { MPORT=$p; break; }
done
[ -n "$PORT" ] && [ -n "$CPORT" ] && [ -n "$MPORT" ] || { echo "no free ports"; exit 2; }
DEMO_CMD=(env DEMO_DIR="$DEMO" DEMO_PORT="$PORT" DEMO_CONTROL_PORT="$CPORT" DEMO_METRICS_PORT="$MPORT"
  DEMO_BIN="$WORK/bin" DEMO_BACKEND="$BACKEND" "$DEMO_SCRIPT")

for _ in $(seq "$LOAD"); do
  ( trap - EXIT; while :; do :; done ) &
  LOADERS+=($!)
done
echo "demo-start-loop: $ROUNDS rounds of $DEMO_SCRIPT (backend $BACKEND) with $LOAD busy loops${SLOW_EXEC:+, exec delayed ${SLOW_EXEC}s}; ports $PORT/$((PORT + 1)), control $CPORT, metrics $MPORT"

FAILED=0
t_all=$(date +%s)
for r in $(seq "$ROUNDS"); do
  t0=$(date +%s%N)
  what=""
  "${DEMO_CMD[@]}" > "$WORK/start.out" 2> "$WORK/start.err" || what="start exited $?"
  [ -z "$what" ] && { "${DEMO_CMD[@]}" status > "$WORK/status.out" 2>&1 || what="status exited $?"; }
  "${DEMO_CMD[@]}" stop > "$WORK/stop.out" 2>&1 || what="${what:+$what, }stop exited $?"
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  if [ -z "$what" ]; then
    printf 'round %2d ok   %5.1fs\n' "$r" "$secs"
  else
    FAILED=$((FAILED + 1))
    keep=$WORK/failed-$r
    mkdir -p "$keep"
    cp "$WORK"/*.out "$WORK"/*.err "$keep/" 2>/dev/null
    # a failed start keeps DEMO_DIR's logs; stop removed them otherwise
    cp "$DEMO"/*.log "$keep/" 2>/dev/null
    printf 'round %2d FAIL %5.1fs: %s: %s (logs: %s)\n' "$r" "$secs" "$what" \
      "$(grep -m1 -E 'exited|not listening|failed' "$WORK/start.err" | tr -d '\n')" "$keep"
    # a failed start leaves DEMO_DIR with its logs: the next round needs it gone
    "${DEMO_CMD[@]}" stop >/dev/null 2>&1
    rm -rf "$DEMO"
  fi
done
echo "demo-start-loop: $((ROUNDS - FAILED)) of $ROUNDS rounds passed in $(( $(date +%s) - t_all ))s"
echo "$ROUNDS starts, $FAILED failed"
[ "$FAILED" = 0 ]
