#!/bin/bash
# e2e-rbd.sh - end-to-end test of the gateway serving Ceph RBD images to the real Linux
# NVMe/TCP initiator. Runs on the HOST (not in the VM):
#
#   tests/vm/e2e-rbd.sh [GATEWAY_BIN]        (default: target/release/nvmeof-gateway)
#
# On the host: starts a micro Ceph (scripts/micro-ceph.sh, bluestore, so that a killed OSD
# restarts with its data), creates rbd/e2e-a (256 MiB), starts the gateway on
# 127.0.0.1:<free port> with two RBD namespaces, nsid 1 = rbd/e2e-a and nsid 2 =
# rbd/e2e-missing, which does not exist (the gateway must log an error naming it and serve
# the other one), then boots the VM (tests/vm/run-in-vm.sh) with tests/vm/e2e-rbd-guest.sh.
# The guest reaches the host's 127.0.0.1 as 10.0.2.2.
#
# Host and guest share one directory (-w): the guest asks the host to act by dropping a
# request file into sig/ (NNN.req: one line, an action from the fixed list below); the host
# loop runs it and answers with NNN.done (first line "ok" or "fail", then details).
#   check IMAGE {zero OFF LEN | cmp OFF FILE}...   rbd export IMAGE once, then check each
#                                    range is zeros / equals FILE (a file in the shared dir)
#   resize IMAGE SIZE                rbd resize (the connected guest must see it)
#   create IMAGE SIZE                rbd create (the gateway's retry must start serving it)
#   osd-outage SECONDS               SIGKILL osd.0 (its PID from the cluster's pids file),
#                                    wait SECONDS, micro-ceph.sh restart-osd, wait until it
#                                    is active again; answers when the OSD is back
# Host steps (timed, PASS/FAIL): cluster start, image creation, gateway start with the
# missing image's error logged and the other namespace served, the VM run (the guest's own
# steps are counted one by one from its summary), final SIGTERM (exit 0).
# Last line: "N passed, N failed" over host and guest steps. Exit 0 only if none failed.
# Whatever happens, the VM, the gateway and the cluster are stopped (by their PIDs).
#
# Env: E2E_LOG_DIR (default target/vm-logs; logs and shared files in $E2E_LOG_DIR/e2e-rbd),
#      E2E_TIMEOUT (VM hard timeout, default 900 s), E2E_PORT (default: a free port),
#      RUST_LOG (gateway, default info), VM_* (see run-in-vm.sh).
set -u
export LC_ALL=C
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

GW_SRC=${1:-$ROOT/target/release/nvmeof-gateway}
case $GW_SRC in /*) ;; *) GW_SRC=$PWD/$GW_SRC ;; esac
TIMEOUT=${E2E_TIMEOUT:-900}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-rbd
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2e0bd00-0000-4000-8000-000000000001
POOL=rbd
IMG=e2e-a
MISSING=e2e-missing
export NO_COLOR=1
exec 3>&1  # the terminal, for progress lines printed while an answer is being written

# shellcheck disable=SC2034  # read by steps.sh
STEP_PREFIX=host:
. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"
shared_dir e2e-rbd  # SH, shared with the guest

# ------------------------------------------------------------- cleanup --
WORK="" CEPHDIR="" GWPID="" VMPID=""
cleanup() {
  stop_vm e2e-rbd
  stop_process "$GWPID" 150 "e2e-rbd: stopping the gateway (pid $GWPID)"
  wait 2>/dev/null
  if [ -n "$CEPHDIR" ]; then
    [ -d "$CEPHDIR/log" ] && { mkdir -p "$SH/ceph-log"; cp "$CEPHDIR"/log/*.log "$SH/ceph-log/" 2>/dev/null; }
    "$ROOT/scripts/micro-ceph.sh" stop "$CEPHDIR" >/dev/null 2>&1 ||
      echo "e2e-rbd: micro-ceph.sh stop $CEPHDIR failed"
  fi
  [ -n "$WORK" ] && rm -rf "$WORK"
  rm -f "$SH"/*.bin 2>/dev/null
  GWPID="" VMPID="" CEPHDIR="" WORK=""
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- setup --
fresh_shared_dir e2e-rbd
GWLOG=$SH/gateway.log
CONF=$SH/gateway.toml
PORT=${E2E_PORT:-$(free_port)}

create_images() {
  timeout -k 5 60 rbd create --size 256M "$POOL/$IMG" || return 1
  if timeout -k 5 60 rbd info "$POOL/$MISSING" >/dev/null 2>&1; then say "$POOL/$MISSING exists"; return 1; fi
  say "rbd ls $POOL: $(timeout 60 rbd ls "$POOL" | tr '\n' ' ')"
}
write_config() {
  cat > "$CONF" <<EOF
[gateway]
name = "e2e-rbd"

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = $PORT

[[subsystem]]
nqn = "$NQN"
allow_any_host = false
hosts = ["$HOSTNQN"]

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
pool = "$POOL"
image = "$IMG"

[[subsystem.namespace]]
nsid = 2
backend = "rbd"
pool = "$POOL"
image = "$MISSING"

[ceph]
conf = "$CEPH_CONF"
keyring = "$CEPH_KEYRING"
EOF
}
start_gateway() {
  [ -x "$GW_SRC" ] || { say "gateway binary not found: $GW_SRC"; return 1; }
  # a private copy: a concurrent cargo build must not replace the binary under the test
  cp "$GW_SRC" "$WORK/nvmeof-gateway" || return 1
  write_config
  "$WORK/nvmeof-gateway" --config "$CONF" --check >/dev/null || { say "--check refused $CONF"; return 1; }
  say "$GW_SRC --config $CONF (log $GWLOG)"
  RUST_LOG=${RUST_LOG:-info} "$WORK/nvmeof-gateway" --config "$CONF" > "$GWLOG" 2>&1 < /dev/null 3>&- &
  GWPID=$!
  for _ in $(seq 300); do  # up to 30 s (opening images talks to the cluster)
    port_free "$PORT" || { say "gateway pid $GWPID listening on 127.0.0.1:$PORT"; return 0; }
    kill -0 "$GWPID" 2>/dev/null || { wait "$GWPID"; say "gateway exited with status $?"; GWPID=""; tail -n 20 "$GWLOG"; return 1; }
    sleep 0.1
  done
  say "not listening on $PORT after 30 s"; return 1
}
missing_logged() { # the error names the image and the field; the subsystem serves 1 namespace
  local line
  line=$(grep -E 'ERROR.*namespace not served' "$GWLOG" | grep -F "$POOL/$MISSING")
  [ -n "$line" ] || { say "no 'namespace not served' error naming $POOL/$MISSING in $GWLOG:"; sed 's/^/    | /' "$GWLOG"; return 1; }
  say "gateway log: $line"
  echo "$line" | grep -q 'subsystem\[0\]\.namespace\[1\]' || { say "the error does not name the field subsystem[0].namespace[1]"; return 1; }
  grep -E "subsystem ready.*$NQN.*namespaces=1|namespaces=1.*$NQN" "$GWLOG" | sed 's/^/    gateway log: /' | grep -q . ||
    { say "no 'subsystem ready ... namespaces=1' line"; return 1; }
}
stop_gateway() { # SIGTERM: exit 0 within 15 s (the images are closed before exiting)
  [ -n "$GWPID" ] || { say "gateway not running"; return 1; }
  kill -0 "$GWPID" 2>/dev/null || { wait "$GWPID"; say "gateway had exited (status $?) before SIGTERM"; GWPID=""; return 1; }
  local t0 rc; t0=$(now)
  kill -TERM "$GWPID"
  for _ in $(seq 150); do kill -0 "$GWPID" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$GWPID" 2>/dev/null; then say "still running 15 s after SIGTERM"; kill -KILL "$GWPID"; wait "$GWPID"; GWPID=""; return 1; fi
  wait "$GWPID"; rc=$?; GWPID=""
  say "gateway exited with status $rc $(since "$t0")s after SIGTERM"
  [ $rc -eq 0 ]
}

# ------------------------------------------------- requests from the guest --
num() { [[ $1 =~ ^[0-9]+$ ]]; }
image_ok() { [ "$1" = "$IMG" ] || [ "$1" = "$MISSING" ]; }
alive() { # PID: running and not a zombie
  local st; st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }; [ "${st%% *}" != Z ]
}
osd_pid() { awk '$2 == "osd.0" {print $1}' "$CEPHDIR/pids" | tail -n 1; }
act_osd_outage() { # SECONDS
  local secs=$1 pid n0 t0 tk
  num "$secs" && [ "$secs" -le 60 ] || { echo fail; echo "bad duration"; return; }
  pid=$(osd_pid)
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = ceph-osd ] && alive "$pid" || { echo fail; echo "osd.0 is not running (pid '$pid')"; return; }
  n0=$(grep -c 'state: booting -> active' "$CEPHDIR/log/osd.0.log")
  t0=$(now)
  kill -KILL "$pid"
  # gone, or a zombie (the daemons are reparented; their reaper may be slow)
  for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
  alive "$pid" && { echo fail; echo "osd.0 (pid $pid) still alive 5 s after SIGKILL"; return; }
  echo "    host: osd.0 (pid $pid) killed at $(date -u +%T.%N | cut -c1-12)" >&3
  sleep "$secs"
  tk=$(since "$t0")
  if ! "$ROOT/scripts/micro-ceph.sh" restart-osd "$CEPHDIR" > "$WORK/restart.out" 2>&1 3>&-; then
    echo fail; echo "restart-osd failed: $(cat "$WORK/restart.out")"; return
  fi
  for _ in $(seq 600); do
    [ "$(grep -c 'state: booting -> active' "$CEPHDIR/log/osd.0.log")" -gt "$n0" ] && break
    sleep 0.1
  done
  if [ "$(grep -c 'state: booting -> active' "$CEPHDIR/log/osd.0.log")" -le "$n0" ]; then
    echo fail; echo "osd.0 not active 60 s after restart-osd"; return
  fi
  echo "    host: osd.0 restarted (pid $(osd_pid)) and active at $(date -u +%T.%N | cut -c1-12)" >&3
  echo ok
  echo "osd.0 pid $pid killed; down ${tk}s before restart-osd; active again after $(since "$t0")s in all; new pid $(osd_pid)"
}
handle() { # reads one request line, prints the answer
  local line; read -r line || true
  # shellcheck disable=SC2086  # the request is a list of words
  set -- $line
  local a=${1:-}; [ $# -gt 0 ] && shift
  case $a in
    check) check_image "$@" ;;
    resize)
      image_ok "${1:-}" && [[ ${2:-} =~ ^[0-9]+[MG]$ ]] || { echo fail; echo "bad resize request"; return; }
      if timeout -k 5 60 rbd resize --no-progress --size "$2" "$POOL/$1" > "$WORK/rbd.out" 2>&1; then
        echo ok; echo "rbd resize --size $2 $POOL/$1: $(timeout 30 rbd info "$POOL/$1" | grep -m1 size)"
      else echo fail; cat "$WORK/rbd.out"; fi ;;
    create)
      image_ok "${1:-}" && [[ ${2:-} =~ ^[0-9]+[MG]$ ]] || { echo fail; echo "bad create request"; return; }
      if timeout -k 5 60 rbd create --size "$2" "$POOL/$1" > "$WORK/rbd.out" 2>&1; then echo ok; echo "rbd create --size $2 $POOL/$1"
      else echo fail; cat "$WORK/rbd.out"; fi ;;
    osd-outage) act_osd_outage "${1:-}" ;;
    *) echo fail; echo "unknown request '$line'" ;;
  esac
}
run_vm() {
  say "tests/vm/run-in-vm.sh -t $TIMEOUT -w $SH tests/vm/e2e-rbd-guest.sh $SH $PORT"
  run_guest -t "$TIMEOUT" -w "$SH" "$ROOT/tests/vm/e2e-rbd-guest.sh" "$SH" "$PORT"
}

# ------------------------------------------------------------------ main --
echo "e2e-rbd: gateway $GW_SRC, port $PORT, shared dir $SH, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
if step cluster.start "micro Ceph (1 mon, 1 OSD on bluestore) on 127.0.0.1" start_cluster --store bluestore &&
   step images "rbd create $POOL/$IMG 256M; $POOL/$MISSING absent" create_images; then
  if step gateway.start "gateway on 127.0.0.1:$PORT, nsid 1 = $POOL/$IMG, nsid 2 = $POOL/$MISSING (missing)" start_gateway; then
    step missing.logged "the error names $POOL/$MISSING and its field; 1 namespace served" missing_logged
    step vm "the guest's steps (tests/vm/e2e-rbd-guest.sh)" run_vm
    step gateway.sigterm "SIGTERM: the gateway exits 0" stop_gateway
  else
    skip missing.logged "gateway did not start"; skip vm "gateway did not start"; skip gateway.sigterm "gateway did not start"
  fi
else
  skip gateway.start "no cluster"; skip missing.logged "no cluster"; skip vm "no cluster"; skip gateway.sigterm "no cluster"
fi
cleanup; trap - EXIT

host_summary "e2e-rbd summary"
