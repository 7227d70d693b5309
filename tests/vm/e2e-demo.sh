#!/bin/bash
# e2e-demo.sh - CI check of the README's first command, scripts/demo.sh, with the real Linux
# initiator. Runs on the HOST (not in the VM):
#
#   tests/vm/e2e-demo.sh [BIN_DIR]       (default: target/release; needs nvmeof-gateway,
#                                         nvmeof-control and nvmeofctl there)
#
# scripts/demo.sh runs as a user runs it, with DEMO_DIR under the log dir, DEMO_PORT and
# DEMO_CONTROL_PORT on free ports (a developer's own demo on 4420/5500 is not disturbed) and
# DEMO_BIN = private copies of BIN_DIR's binaries (a concurrent cargo build must not replace
# them under the test; tests/run.sh builds them just before, with the command demo.sh uses).
# Host steps (timed, PASS/FAIL):
#   binaries      private copies of the three binaries
#   demo.start    `scripts/demo.sh` exits 0 within START_BOUND_S and prints the nvme discover
#                 and connect lines for its port
#   demo.status   `scripts/demo.sh status` exits 0 and says control, gw1, gw2 and the micro
#                 Ceph run; the recorded PIDs (DEMO_DIR/*.pid, DEMO_DIR/ceph/pids) are saved
#   vm            tests/vm/e2e-demo-guest.sh in the VM (its own steps counted one by one):
#                 discover, connect to both gateways, ANA states, data, kill -9 of gw1
#   metrics       gw2's Prometheus /metrics (DEMO_METRICS_PORT + 1) after the guest's steps:
#                 ANA group 1 optimized there, and the 4 MiB the guest wrote through it
#                 after the failover counted as written bytes of namespace 1; the control
#                 plane's (+2): it leads, gw1 is not available, group 1 is held by gw2
#   demo.stop     `scripts/demo.sh stop` exits 0 within STOP_BOUND_S; none of the recorded
#                 processes (gateways, control plane, micro Ceph daemons) is left, nothing
#                 listens on the demo's ports, DEMO_DIR is gone
# The guest asks the host to act by dropping a request file into sig/ (NNN.req: one line, an
# action from this fixed list); the host answers with NNN.done (first line "ok" or "fail"):
#   check {cmp OFF FILE}...   rbd export rbd/demo (the demo's cluster: DEMO_DIR/ceph/env),
#                             each range must equal FILE (a file in the shared dir)
#   kill-gw1                  kill -9 of the PID in DEMO_DIR/gw1.pid; answers once it is dead
# Last line: "N passed, N failed" over host and guest steps. Exit 0 only if none failed.
# Whatever happens, the VM, demo.sh and every process demo.sh started are stopped (demo.sh
# stop, then the recorded PIDs), and the micro Ceph with them.
#
# Env: E2E_LOG_DIR (default target/vm-logs; logs and shared files in $E2E_LOG_DIR/e2e-demo),
#      E2E_TIMEOUT (VM hard timeout, default 300 s), START_BOUND_S (default 90),
#      STOP_BOUND_S (default 45), FAILOVER_BOUND_S (guest, default 20), RUST_LOG, VM_*.
set -u
export LC_ALL=C
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

BIN_SRC=${1:-$ROOT/target/release}
case $BIN_SRC in /*) ;; *) BIN_SRC=$PWD/$BIN_SRC ;; esac
TIMEOUT=${E2E_TIMEOUT:-300}
START_BOUND_S=${START_BOUND_S:-90}
STOP_BOUND_S=${STOP_BOUND_S:-45}
FAILOVER_BOUND_S=${FAILOVER_BOUND_S:-20}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:demo
POOL=rbd
IMAGE=demo
export NO_COLOR=1
export FAILOVER_BOUND_S
exec 3>&1  # the terminal, for progress lines printed while an answer is being written

# shellcheck disable=SC2034  # read by steps.sh
STEP_PREFIX=host:
. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"
shared_dir e2e-demo  # SH, shared with the guest
DEMO=$SH/demo        # DEMO_DIR

# ------------------------------------------------------------- cleanup --
WORK="" VMPID="" DEMOPID=""
declare -A RECORDED=()  # "PID" -> "comm name": every process demo.sh started
alive() { # PID COMM: running (not a zombie) and still that binary
  local st
  [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }; [ "${st%% *}" != Z ]
}
comm_of() { case $1 in control) echo nvmeof-control ;; *) echo nvmeof-gateway ;; esac; }
record_pids() { # the PIDs in DEMO_DIR now, added to RECORDED
  local n p name comm
  for n in control gw1 gw2; do
    p=$(cat "$DEMO/$n.pid" 2>/dev/null) && [[ $p =~ ^[0-9]+$ ]] && RECORDED[$p]="$(comm_of $n) $n"
  done
  if [ -f "$DEMO/ceph/pids" ]; then
    while read -r p name comm; do [[ $p =~ ^[0-9]+$ ]] && RECORDED[$p]="$comm $name"; done < "$DEMO/ceph/pids"
  fi
}
left_over() { # prints "PID name" of every recorded process still alive
  local p
  for p in "${!RECORDED[@]}"; do
    # shellcheck disable=SC2086  # "comm name"
    set -- ${RECORDED[$p]}
    alive "$p" "$1" && echo "$p $2"
  done
}
# demo.sh with the test's environment (set once the ports and WORK are known); started as a
# simple command, so that $! of a background start is demo.sh itself; always with 3>&- (the
# daemons must not inherit fd 3)
DEMO_CMD=()
save_demo_logs() { # the demo's logs survive its stop (which removes DEMO_DIR)
  [ -d "$DEMO" ] || return 0
  mkdir -p "$SH/demo-logs/ceph"
  cp "$DEMO"/*.log "$DEMO"/*.toml "$SH/demo-logs/" 2>/dev/null
  cp "$DEMO"/ceph/log/*.log "$SH/demo-logs/ceph/" 2>/dev/null
  return 0
}
cleanup() {
  local p
  stop_vm e2e-demo
  stop_process "$DEMOPID" 100 "e2e-demo: stopping scripts/demo.sh (pid $DEMOPID)"
  wait 2>/dev/null
  if [ -d "$DEMO" ] && [ ${#DEMO_CMD[@]} -gt 0 ]; then
    record_pids
    save_demo_logs
    echo "e2e-demo: scripts/demo.sh stop (cleanup)"
    "${DEMO_CMD[@]}" stop > "$SH/demo-stop-cleanup.out" 2>&1 3>&- & p=$!
    for _ in $(seq 600); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null
  fi
  for p in $(left_over | cut -d' ' -f1); do
    echo "e2e-demo: pid $p (${RECORDED[$p]}) still alive: SIGKILL"
    kill -KILL "$p" 2>/dev/null
  done
  if [ -d "$DEMO/ceph" ]; then
    "$ROOT/scripts/micro-ceph.sh" stop "$DEMO/ceph" >/dev/null 2>&1 || echo "e2e-demo: micro-ceph.sh stop $DEMO/ceph failed"
  fi
  [ -n "$WORK" ] && rm -rf "$WORK"
  rm -f "$SH"/*.bin 2>/dev/null
  VMPID="" DEMOPID="" WORK=""
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- setup --
fresh_shared_dir e2e-demo

# an unused port pair P, P+1 for the gateways, a port for the control plane and three for
# the metrics, in free_port's range (requests.sh says why)
PORT="" CPORT=""
for _ in $(seq 50); do
  p=$(free_port) && port_unused $((p + 1)) && { PORT=$p; break; }
done
CPORT=$(free_port "$PORT" $((PORT + 1)))
MPORT=""
for _ in $(seq 50); do
  p=$(free_port "$PORT" $((PORT + 1)) "$CPORT") || continue
  case " $PORT $((PORT + 1)) $CPORT " in *" $((p + 1)) "* | *" $((p + 2)) "*) continue ;; esac
  port_unused $((p + 1)) && port_unused $((p + 2)) && { MPORT=$p; break; }
done
[ -n "$PORT" ] && [ -n "$CPORT" ] && [ -n "$MPORT" ] || { echo "no free ports"; echo "0 passed, 1 failed"; exit 2; }
DEMO_CMD=(env DEMO_DIR="$DEMO" DEMO_PORT="$PORT" DEMO_CONTROL_PORT="$CPORT" DEMO_METRICS_PORT="$MPORT" DEMO_BIN="$WORK/bin"
  RUST_LOG="${RUST_LOG:-info}" "$ROOT/scripts/demo.sh")

START_S=""
demo_start() {
  local t0 rc out=$SH/demo-start.out err=$SH/demo-start.err
  t0=$(now)
  say "DEMO_DIR=$DEMO DEMO_PORT=$PORT DEMO_CONTROL_PORT=$CPORT DEMO_BIN=$WORK/bin scripts/demo.sh"
  "${DEMO_CMD[@]}" > "$out" 2> "$err" 3>&- &
  DEMOPID=$!
  # the bound: the cluster, the control plane, two gateways, configuration, optimized on gw1
  for _ in $(seq $((START_BOUND_S * 10))); do kill -0 "$DEMOPID" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$DEMOPID" 2>/dev/null; then
    say "scripts/demo.sh still running after ${START_BOUND_S}s:"; sed 's/^/    | /' "$err"
    return 1  # cleanup stops it and what it started
  fi
  wait "$DEMOPID"; rc=$?; DEMOPID=""
  START_S=$(since "$t0")
  record_pids
  sed 's/^/    stderr | /' "$err"
  sed 's/^/    stdout | /' "$out"
  say "scripts/demo.sh exited with status $rc after ${START_S}s"
  [ $rc -eq 0 ] || return 1
  local l ok=0
  for l in "nvme discover -t tcp -a 127.0.0.1 -s $PORT" \
           "nvme connect-all -t tcp -a 127.0.0.1 -s $PORT" \
           "nvme discover -t tcp -a 10.0.2.2 -s $PORT" \
           "nvme connect  -t tcp -a 10.0.2.2 -s $PORT -n $NQN" \
           "nvme connect  -t tcp -a 10.0.2.2 -s $((PORT + 1)) -n $NQN"; do
    grep -qF -- "$l" "$out" || { say "stdout lacks the line '$l'"; ok=1; }
  done
  return $ok
}

demo_status() {
  local rc out=$SH/demo-status.out n ok=0
  timeout -k 5 60 "${DEMO_CMD[@]}" status > "$out" 2>&1 3>&-
  rc=$?
  sed 's/^/    | /' "$out"
  say "scripts/demo.sh status exited with status $rc"
  [ $rc -eq 0 ] || ok=1
  for n in control gw1 gw2; do
    grep -qE "^demo: $n running \(pid [0-9]+\)" "$out" || { say "status does not say $n runs"; ok=1; }
  done
  grep -q '^demo: micro Ceph running' "$out" || { say "status does not say the micro Ceph runs"; ok=1; }
  record_pids
  local p names=""
  for p in "${!RECORDED[@]}"; do names+="${RECORDED[$p]#* }=$p "; done
  say "recorded PIDs: $names"
  left_over > "$SH/pids-alive.txt"
  # control, gw1, gw2, mon.a and osd.0, all alive
  [ "$(wc -l < "$SH/pids-alive.txt")" -ge 5 ] || { say "only $(wc -l < "$SH/pids-alive.txt") recorded processes alive: $(tr '\n' ' ' < "$SH/pids-alive.txt")"; ok=1; }
  return $ok
}

# ------------------------------------------------- requests from the guest --
act_check() { # {cmp OFF FILE}...
  local exp=$WORK/export.img
  rm -f "$exp"
  if ! (eval "$("$ROOT/scripts/micro-ceph.sh" env "$DEMO/ceph")" &&
        timeout -k 5 120 rbd export --no-progress "$POOL/$IMAGE" "$exp") > "$WORK/export.err" 2>&1; then
    echo fail; echo "rbd export $POOL/$IMAGE failed: $(cat "$WORK/export.err")"; return
  fi
  check_export "rbd export $POOL/$IMAGE (the demo's cluster, $DEMO/ceph): $(stat -c %s "$exp") bytes" "$exp" "$@"
  rm -f "$exp"
}
act_kill_gw1() {
  local p
  p=$(cat "$DEMO/gw1.pid" 2>/dev/null)
  [[ $p =~ ^[0-9]+$ ]] && alive "$p" nvmeof-gateway || { echo fail; echo "gw1 is not running (pid file: '$p')"; return; }
  kill -KILL "$p"
  for _ in $(seq 50); do alive "$p" nvmeof-gateway || break; sleep 0.1; done
  alive "$p" nvmeof-gateway && { echo fail; echo "gw1 (pid $p) alive 5 s after SIGKILL"; return; }
  echo "    host: gw1 (pid $p) killed with SIGKILL at $(date -u +%T.%N | cut -c1-12)" >&3
  echo ok; echo "gw1 (pid $p from $DEMO/gw1.pid) killed (SIGKILL)"
}
handle() { # reads one request line, prints the answer
  local line; read -r line || true
  # shellcheck disable=SC2086  # the request is a list of words
  set -- $line
  local a=${1:-}; [ $# -gt 0 ] && shift
  case $a in
    check) act_check "$@" ;;
    kill-gw1) act_kill_gw1 ;;
    *) echo fail; echo "unknown request '$line'" ;;
  esac
}
size_bytes() { # the image's size, as the guest must see it
  (eval "$("$ROOT/scripts/micro-ceph.sh" env "$DEMO/ceph")" &&
    timeout -k 5 30 rbd info --format json "$POOL/$IMAGE") 2>/dev/null |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["size"])'
}
run_vm() {
  local size
  size=$(size_bytes) || { say "rbd info $POOL/$IMAGE failed"; GUEST_FAIL=1; return 1; }
  say "rbd/$IMAGE: $size bytes"
  say "tests/vm/run-in-vm.sh -t $TIMEOUT -w $SH -e FAILOVER_BOUND_S tests/vm/e2e-demo-guest.sh $SH $PORT $size"
  run_guest -t "$TIMEOUT" -w "$SH" -e FAILOVER_BOUND_S "$ROOT/tests/vm/e2e-demo-guest.sh" \
    "$SH" "$PORT" "$size"
}

# GET http://127.0.0.1:PORT/metrics into FILE (the format's content type checked)
fetch_metrics() { # PORT FILE
  python3 - "http://127.0.0.1:$1/metrics" > "$2" 2> "$2.err" <<'PY' || { say "GET /metrics on :$1 failed: $(cat "$2.err")"; return 1; }
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=10) as r:
    assert r.status == 200, r.status
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers["Content-Type"]
    sys.stdout.write(r.read().decode())
PY
}
# gw2 served the guest after the failover, and the control plane moved group 1 to it: the
# metrics of both say so
metrics_check() {
  local gw2=$SH/gw2-metrics.txt control=$SH/control-metrics.txt
  fetch_metrics $((MPORT + 1)) "$gw2" && fetch_metrics $((MPORT + 2)) "$control" || return 1
  grep -E '^nvmeof_(ana_group_state|namespace_(ops|bytes)_total)\{' "$gw2" | grep -F "$NQN" | sed 's/^/    gw2 | /'
  grep -E '^nvmeof_control_(leader|gateway_info|ana_group_info)' "$control" | sed 's/^/    control | /'
  python3 - "$gw2" "$control" "$NQN" <<'PY'
import re, sys
def parse(path):
    samples = []
    for line in open(path).read().splitlines():
        m = re.match(r'(\w+)(?:\{(.*)\})? (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return samples
def value(samples, name, want):
    for n, labels, v in samples:
        if n == name and all(labels.get(k) == x for k, x in want.items()):
            return v
    return None
gw2, control, nqn = parse(sys.argv[1]), parse(sys.argv[2]), sys.argv[3]
problems = []
if value(gw2, "nvmeof_ana_group_state", {"subsystem": nqn, "ana_group": "1", "state": "optimized"}) != 1:
    problems.append("gw2 does not report ANA group 1 optimized")
written = value(gw2, "nvmeof_namespace_bytes_total", {"subsystem": nqn, "nsid": "1", "op": "write"})
if written is None or written < 4 << 20:
    problems.append(f"gw2 counted {written} bytes written to namespace 1, the guest wrote 4 MiB through it")
if value(control, "nvmeof_control_leader", {}) != 1:
    problems.append("the control plane does not say it leads")
if value(control, "nvmeof_control_gateway_info", {"gateway": "gw1", "availability": "available"}) is not None:
    problems.append("the control plane still calls gw1 available")
if value(control, "nvmeof_control_ana_group_info", {"ana_group": "1", "owner": "gw1", "holder": "gw2"}) != 1:
    problems.append("the control plane does not say gw2 holds gw1's ANA group 1")
for p in problems:
    print("    " + p)
if not problems:
    print(f"    gw2: ANA group 1 optimized, {written:.0f} bytes written to namespace 1; control plane: leads, gw1 not available, group 1 held by gw2")
sys.exit(1 if problems else 0)
PY
}

STOP_S=""
demo_stop() {
  local t0 rc out=$SH/demo-stop.out p ok=0
  record_pids
  save_demo_logs
  t0=$(now)
  "${DEMO_CMD[@]}" stop > "$out" 2>&1 3>&- &
  DEMOPID=$!
  for _ in $(seq $((STOP_BOUND_S * 10))); do kill -0 "$DEMOPID" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$DEMOPID" 2>/dev/null; then
    say "scripts/demo.sh stop still running after ${STOP_BOUND_S}s:"; sed 's/^/    | /' "$out"
    return 1
  fi
  wait "$DEMOPID"; rc=$?; DEMOPID=""
  STOP_S=$(since "$t0")
  sed 's/^/    | /' "$out"
  say "scripts/demo.sh stop exited with status $rc after ${STOP_S}s"
  [ $rc -eq 0 ] || ok=1
  left_over > "$SH/pids-left.txt"
  if [ -s "$SH/pids-left.txt" ]; then say "still running: $(tr '\n' ';' < "$SH/pids-left.txt")"; ok=1
  else say "none of the ${#RECORDED[@]} recorded processes ($(for p in "${!RECORDED[@]}"; do printf '%s ' "${RECORDED[$p]#* }"; done)) is left"; fi
  for p in "$PORT" $((PORT + 1)) "$CPORT"; do
    port_free "$p" || { say "something still listens on 127.0.0.1:$p: $(ss -Hltnp "sport = :$p" | head -n 2)"; ok=1; }
  done
  [ ! -e "$DEMO" ] || { say "$DEMO still exists: $(ls -A "$DEMO" | tr '\n' ' ')"; ok=1; }
  [ $ok = 0 ] && say "nothing listens on $PORT, $((PORT + 1)), $CPORT; $DEMO removed"
  return $ok
}

# ------------------------------------------------------------------ main --
echo "e2e-demo: binaries from $BIN_SRC, DEMO_PORT $PORT (gw2 $((PORT + 1))), DEMO_CONTROL_PORT $CPORT, DEMO_METRICS_PORT $MPORT, DEMO_DIR $DEMO, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
if step binaries "private copies of nvmeof-gateway, nvmeof-control, nvmeofctl (DEMO_BIN)" copy_binaries "$WORK/bin" &&
   step demo.start "scripts/demo.sh exits 0 within ${START_BOUND_S}s, prints the nvme discover/connect lines" demo_start; then
  if step demo.status "scripts/demo.sh status: control, gw1, gw2 and the micro Ceph run" demo_status; then
    if step vm "the guest's steps (tests/vm/e2e-demo-guest.sh)" run_vm; then
      step metrics "/metrics of gw2 (group 1 optimized, the guest's writes counted) and of the control plane (group 1 held by gw2)" metrics_check
    else
      skip metrics "the guest's steps failed"
    fi
  else
    skip vm "the demo does not run"; skip metrics "the demo does not run"
  fi
  step demo.stop "scripts/demo.sh stop exits 0 within ${STOP_BOUND_S}s: no process left, DEMO_DIR removed" demo_stop
else
  skip demo.status "no demo"; skip vm "no demo"; skip metrics "no demo"; skip demo.stop "no demo"
fi
cleanup; trap - EXIT

demo_figures() {
  grep -E '^FAILOVER ' "$VMOUT" 2>/dev/null
  echo "TIMES demo.sh start ${START_S:-?}s, stop ${STOP_S:-?}s"
}
host_summary "e2e-demo summary" demo_figures
