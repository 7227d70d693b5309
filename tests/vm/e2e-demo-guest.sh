#!/bin/bash
# e2e-demo-guest.sh - the in-guest half of tests/vm/e2e-demo.sh (run by it through
# tests/vm/run-in-vm.sh; not meant to be run by hand):
#
#   e2e-demo-guest.sh SHARED_DIR PORT SIZE_BYTES
#
# scripts/demo.sh runs on the host: gw1 on PORT (ANA group 1, the namespace's), gw2 on PORT+1,
# both serving rbd/demo (SIZE_BYTES) as nsid 1 of the demo subsystem. The guest reaches the
# host's 127.0.0.1 as 10.0.2.2 with the real Linux initiator and native NVMe multipath, and
# asks the host to act through request files in SHARED_DIR/sig (see e2e-demo.sh).
# Steps (each timed, PASS/FAIL):
#   setup      nvme-tcp loaded, native multipath on
#   discover   nvme discover via gw1's port: the demo subsystem on both gateways' ports
#   connect    nvme connect to both ports: one namespace block device (the multipath head)
#              with two paths, SIZE_BYTES, 512 B blocks
#   ana        sysfs ana_state: optimized on the gw1 path, non-optimized or inaccessible on
#              the gw2 path
#   data       4 MiB of random data written with O_DIRECT, read back equal here and in the
#              host's `rbd export`
#   failover   the host kills gw1 with kill -9: a read of the 4 MiB completes through gw2
#              within FAILOVER_BOUND_S and equals them, gw2's path becomes optimized (gw1's
#              is not), 4 MiB more written and read back, both equal in `rbd export`
#   disconnect nvme disconnect: no controller left
# Lines "FAILOVER ..." carry the measured times. Last line: "N passed, N failed".
set -u
export LC_ALL=C

USAGE="usage: e2e-demo-guest.sh SHARED_DIR PORT SIZE_BYTES"
SH=${1:?$USAGE}
PORT=${2:?$USAGE}
SIZE_BYTES=${3:?$USAGE}
PORTS=("$PORT" "$((PORT + 1))")
SIG=$SH/sig
ADDR=10.0.2.2
NQN=nqn.2016-06.io.ceph-nvmeof-rs:demo   # scripts/demo.sh's subsystem
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2ede400-0000-4000-8000-000000000001
HOSTID=e2ede400-0000-4000-8000-000000000001
MIB=1048576
DATA_OFF_MIB=64     # step data
DATA2_OFF_MIB=80    # written after the failover
FAILOVER_BOUND_S=${FAILOVER_BOUND_S:-20}  # kill -9 of gw1 -> a read completed through gw2
WORK=/tmp/e2e-demo
mkdir -p "$WORK"
LOGDIR=$SH/guest
mkdir -p "$LOGDIR"
# --ctrl-loss-tmo: gw1's path keeps reconnecting after the kill until the disconnect
COPTS=(-t tcp -a "$ADDR" --ctrl-loss-tmo=60 --reconnect-delay=1 --hostnqn="$HOSTNQN" --hostid="$HOSTID")

. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"  # ask
. "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh"
on_step_failure() { dmesg | grep -iE 'nvme' | tail -n 8 | sed 's/^/    dmesg: /'; }


# ------------------------------------------------------------- multipath --
subsys_dir() {
  local s n
  for s in /sys/class/nvme-subsystem/nvme-subsys*; do
    [ -e "$s/subsysnqn" ] || continue
    n=""; read -r n < "$s/subsysnqn" 2>/dev/null
    [ "$n" = "$NQN" ] && { echo "$s"; return 0; }
  done
  return 1
}
head_dev() { # the multipath head of nsid 1
  local s n b id
  s=$(subsys_dir) || return 1
  for n in "$s"/nvme*n*; do
    b=${n##*/}
    case $b in *c*n*) continue ;; esac  # hidden per-path nodes
    id=""; read -r id < "/sys/block/$b/nsid" 2>/dev/null
    [ "$id" = 1 ] && [ -b "/dev/$b" ] && { echo "/dev/$b"; return 0; }
  done
  return 1
}
gw_of_ctrl() { # nvmeC: the gateway (gw1/gw2) from the controller's trsvcid; sets GW
  local a="" p i
  read -r a < "/sys/class/nvme/$1/address" 2>/dev/null
  p=${a#*trsvcid=}; p=${p%%,*}
  GW="gw?"
  for i in "${!PORTS[@]}"; do [ "${PORTS[$i]}" = "$p" ] && GW=gw$((i + 1)); done
}
# path_scan: PATHS_OUT = one "gwN ctrl-state ana-state pathdev" per path of nsid 1;
# ANA[gwN] = that path's ana_state; OPT = the gateways with a live optimized path
declare -A ANA=()
path_scan() {
  local h p b c st ana
  PATHS_OUT=() OPT="" ANA=()
  h=$(head_dev) || return 1
  h=${h#/dev/nvme}  # S n 1
  for p in /sys/block/nvme"${h%%n*}"c*n"${h#*n}"; do
    [ -e "$p" ] || continue
    b=${p##*/}; c=${b#nvme*c}; c=nvme${c%%n*}
    st="" ana=""
    read -r st < "/sys/class/nvme/$c/state" 2>/dev/null
    read -r ana < "$p/ana_state" 2>/dev/null
    gw_of_ctrl "$c"
    PATHS_OUT+=("$GW $st $ana $b")
    ANA[$GW]=$ana
    [ "$st" = live ] && [ "$ana" = optimized ] && OPT+=${OPT:+ }$GW
  done
  return 0
}
show_paths() { path_scan; say "nsid 1 paths (gateway, controller state, ana_state, path): $(printf '%s; ' "${PATHS_OUT[@]}")"; }
# wait_optimized gwN SECONDS: until nsid 1 is optimized on gwN and on no other path
wait_optimized() {
  local end; end=$(awk -v n="$(now)" -v t="$2" 'BEGIN{print n + t}')
  while :; do
    path_scan && [ "$OPT" = "$1" ] && return 0
    awk -v n="$(now)" -v e="$end" 'BEGIN{exit !(n > e)}' && return 1
    sleep 0.1
  done
}

# ------------------------------------------------------------------ steps --
discover() { discover_on_ports "$PORT" "${PORTS[0]},${PORTS[1]}"; }

DEV=""
connect_both() {
  local i out n b
  for i in 0 1; do
    out=$(timeout -k 5 90 nvme connect "${COPTS[@]}" -s "${PORTS[$i]}" -n "$NQN" 2>&1) ||
      { say "nvme connect to gw$((i + 1)) ($ADDR:${PORTS[$i]}) failed: $out"; return 1; }
    say "gw$((i + 1)) ($ADDR:${PORTS[$i]}): ${out:-connected}"
  done
  for _ in $(seq 200); do path_scan 2>/dev/null && [ ${#PATHS_OUT[@]} -eq 2 ] && break; sleep 0.1; done
  DEV=$(head_dev) || { say "no block device for nsid 1 of $NQN"; return 1; }
  show_paths
  n=0
  for b in "$(subsys_dir)"/nvme*n*; do
    b=${b##*/}
    case $b in *c*n*) ;; *) [ -b "/dev/$b" ] && n=$((n + 1)) ;; esac
  done
  [ "$n" -eq 1 ] || { say "$n namespace block devices for $NQN, expected 1"; return 1; }
  [ ${#PATHS_OUT[@]} -eq 2 ] || { say "${#PATHS_OUT[@]} path(s) to nsid 1, expected 2"; return 1; }
  [ -n "${ANA[gw1]:-}" ] && [ -n "${ANA[gw2]:-}" ] || { say "not one path per gateway"; return 1; }
  local sz lbs
  sz=$(( $(cat "/sys/block/${DEV#/dev/}/size") * 512 )); lbs=$(cat "/sys/block/${DEV#/dev/}/queue/logical_block_size")
  say "nsid 1: $DEV, $sz bytes, logical block $lbs"
  [ "$sz" -eq "$SIZE_BYTES" ] || { say "size $sz != $SIZE_BYTES (rbd/demo)"; return 1; }
  [ "$lbs" -eq 512 ] || { say "logical block size $lbs != 512"; return 1; }
}

ana_check() {
  wait_optimized gw1 20
  show_paths
  nvme list-subsys "$DEV" 2>&1 | sed 's/^/    | /'
  [ "$OPT" = gw1 ] || { say "optimized on '$OPT', expected gw1 only"; return 1; }
  [ "${ANA[gw1]:-}" = optimized ] || { say "gw1 path: ana_state '${ANA[gw1]:-}'"; return 1; }
  case ${ANA[gw2]:-} in
    non-optimized | inaccessible) say "gw1 path optimized, gw2 path ${ANA[gw2]}" ;;
    *) say "gw2 path: ana_state '${ANA[gw2]:-}', expected non-optimized or inaccessible"; return 1 ;;
  esac
}

# write_read NAME OFFSET_MIB: 4 MiB of random data with O_DIRECT, read back, compare
write_read() {
  head -c $((4 * MIB)) /dev/urandom > "$SH/$1.bin" || return 1
  timeout -k 5 120 dd if="$SH/$1.bin" of="$DEV" bs=1M seek="$2" oflag=direct conv=fsync status=none ||
    { say "dd write of $1 at $2 MiB failed"; return 1; }
  timeout -k 5 120 dd if="$DEV" bs=1M skip="$2" count=4 iflag=direct status=none | cmp - "$SH/$1.bin" ||
    { say "$1: the 4 MiB at $2 MiB read back differ"; return 1; }
  say "$1: 4 MiB written at $2 MiB (O_DIRECT) and read back identical"
}
data() {
  write_read data $DATA_OFF_MIB || return 1
  ask 120 check cmp $((DATA_OFF_MIB * MIB)) data.bin
}

failover() {
  local ok=0 tk tread topt
  wait_optimized gw1 10 || { say "nsid 1 is not optimized on gw1 only before the kill"; show_paths; return 1; }
  ask 30 kill-gw1 || return 1
  tk=$(now)
  # I/O issued at once: the multipath head holds it until a path can serve it
  if timeout -k 5 "$FAILOVER_BOUND_S" dd if="$DEV" bs=1M skip=$DATA_OFF_MIB count=4 iflag=direct status=none > "$WORK/read.bin"; then
    tread=$(since "$tk")
  else
    say "the read issued after the kill did not complete within ${FAILOVER_BOUND_S}s"; show_paths; return 1
  fi
  # the only live optimized path is gw2's (gw1's keeps its last ana_state while it reconnects)
  if wait_optimized gw2 30; then topt=$(since "$tk")
  else say "nsid 1 not optimized on gw2 only within 30 s of the kill"; show_paths; return 1; fi
  show_paths
  echo "FAILOVER kill -9 of gw1 (times from the host's answer) -> the 4 MiB read issued at once completed after ${tread}s (bound ${FAILOVER_BOUND_S}s); gw2 the only live optimized path after ${topt}s"
  cmp "$WORK/read.bin" "$SH/data.bin" || { say "the 4 MiB read after the kill differ from those written"; ok=1; }
  [ $ok = 0 ] && say "the 4 MiB read through gw2 equal those written before the kill"
  write_read data2 $DATA2_OFF_MIB || return 1
  ask 120 check cmp $((DATA_OFF_MIB * MIB)) data.bin cmp $((DATA2_OFF_MIB * MIB)) data2.bin || ok=1
  local r; r=$(dmesg | grep -ciE 'I/O error|blk_update_request|Buffer I/O')
  [ "$r" -eq 0 ] || { say "dmesg has $r I/O error line(s)"; dmesg | grep -iE 'I/O error|blk_update_request|Buffer I/O' | tail -n 5 | sed 's/^/    dmesg: /'; ok=1; }
  return $ok
}

disconnect() {
  timeout -k 5 60 nvme disconnect -n "$NQN" 2>&1 | sed 's/^/    /'
  for _ in $(seq 100); do
    subsys_dir >/dev/null && [ -n "$(ls -d "$(subsys_dir)"/nvme[0-9]* 2>/dev/null)" ] || return 0
    sleep 0.1
  done
  say "controllers left: $(ls "$(subsys_dir)")"; return 1
}

cleanup() {
  delete_ctrls "$NQN"
  dmesg > "$LOGDIR/dmesg.log" 2>/dev/null
}
trap cleanup EXIT

# ------------------------------------------------------------------ main --
echo "e2e-demo-guest: guest $(uname -r), $(nproc) vCPU, nvme-cli $(nvme version 2>/dev/null | head -1 | awk '{print $3}'), gw1 at $ADDR:${PORTS[0]}, gw2 at $ADDR:${PORTS[1]}"
LATER=(ana data failover disconnect)
if step setup "load nvme-tcp; native multipath on" multipath_setup &&
   step discover "nvme discover -t tcp -a $ADDR -s $PORT: the demo subsystem on both ports" discover &&
   step connect "nvme connect to both gateways: one namespace, two paths" connect_both; then
  step ana "ana_state: optimized on gw1's path, not on gw2's" ana_check
  if step data "4 MiB random O_DIRECT: read back here, equal in rbd export" data; then
    step failover "kill -9 gw1: I/O continues through gw2 (optimized), data intact" failover
  else skip failover "no data written"; fi
  step disconnect "nvme disconnect" disconnect
else
  for s in "${LATER[@]}"; do skip "$s" "not connected"; done
fi
cleanup; trap - EXIT

guest_summary "e2e-demo guest summary (guest $(uname -r), TCG)"
[ $FAIL -eq 0 ]
