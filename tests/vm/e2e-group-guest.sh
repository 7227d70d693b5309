#!/bin/bash
# e2e-group-guest.sh - the in-guest half of tests/vm/e2e-group.sh (run by it through
# tests/vm/run-in-vm.sh; not meant to be run by hand):
#
#   e2e-group-guest.sh SHARED_DIR ROUNDS PORT1,PORT2[,PORT3...]
#
# The gateways of one group run on the host (gwN on PORTn owns ANA group N = nsid N); the guest reaches them as 10.0.2.2 with the real Linux
# initiator and native NVMe multipath (nvme_core multipath=Y, Debian's default). It asks the
# host to act through request files in SHARED_DIR/sig (see e2e-group.sh).
# Steps (each timed, PASS/FAIL):
#   setup          nvme-tcp loaded, native multipath on
#   discover       the discovery log of gw1 lists the subsystem on every gateway's port
#   connect        nvme connect to every gateway: one multipath head per namespace, a path per gateway
#   ana            per namespace exactly one optimized path, on its group's owner (sysfs
#                  ana_state of every path; nvme list-subsys printed)
#   data           8 MiB of random data per namespace, equal in `rbd export`
#   failover-K     (K = 1..ROUNDS) under fio --verify=crc32c (4K randwrite, QD4, 200 IOPS, 12 MiB) and
#                  a probe (4K O_DIRECT writes back to back, each completion time logged, its
#                  blocks read back and checked at the end): kill -9 of gw1 (optimized for
#                  nsid 1); nsid 1 optimized on one survivor only; gw1 restarted: failback (optimized on
#                  gw1 only); zero fio errors, zero verify errors, zero probe errors. The I/O
#                  pause is the probe's longest gap between two completed writes, from the
#                  kill to the restart (failover) and after the restart (failback).
#   pauses         median and max of the failover pauses (goal <= 1 s; fails over 3 s)
#   freeze-K       (K = 1..3) the same load: gw1 frozen (SIGSTOP: its connections stay open,
#                  so the control plane notices missed beacons, the host its keep-alive
#                  timeout, KATO 1 s); nsid 1 optimized on one survivor only; thawed: gw1 is
#                  fenced, drops its clients, and gets the group back on fresh ones (failback);
#                  zero errors. The pause: the probe's longest gap from the freeze to the thaw.
#   freeze-pauses  median and max of the freeze pauses (goal <= 3 s; printed)
#   cut-K          (K = 1..CUT_ROUNDS, 3; only when the host put gwN, the last gateway, in a
#                  network namespace: E2E_NETCUT=1, SHARED_DIR/netcut names it) the same load
#                  on nsid N: gwN's link taken down (a partition from the control plane, Ceph
#                  and this host at once, no connection reset: missed beacons and keep-alive
#                  timeouts again); nsid N optimized on one survivor only; the link back: gwN
#                  is fenced and gets the group back on fresh clients; zero errors
#   cut-pauses     median and max of the network-cut pauses (goal <= 3 s; printed)
#   part-K         (K = 1..PART_ROUNDS, 2; with the network namespace) the same load on nsid
#                  N: gwN cut from Ceph and the control plane only, this host still reaching
#                  it (nothing resets, its keep-alives still answer): gwN must give its group
#                  up by itself (lease), its stuck writes come back to this host, which
#                  re-sends them through the survivor; nsid N optimized on one survivor only;
#                  healed: failback; zero errors; gwN's log has the self-demotion
#   part-pauses    median and max of the partition pauses (goal <= 3 s; printed)
#   ceph-cut-K     (K = 1..CEPH_CUT_ROUNDS, 2; with the network namespace) the same load on
#                  nsid N: gwN cut from Ceph only, still beaconing to the control plane and
#                  reached by this host: gwN must report the cluster stalled, the leader
#                  fences it and moves the group, gwN hands its stuck writes back to this
#                  host (closed controller), which re-sends them through the survivor; nsid
#                  N optimized on one survivor only; healed: failback; zero errors; gwN's
#                  log has the stall
#   ceph-cut-pauses  median and max of the Ceph-cut pauses (goal <= 3 s; printed; fails over
#                  10 s: the stuck writes waited for the host's I/O timeout)
#   osd-cut-K      (K = 1..OSD_CUT_ROUNDS, 2; with the network namespace) the same load on
#                  nsid N: gwN cut from the OSD only, the monitor and the control plane still
#                  answering it: gwN must name the OSD, which answers the leader, so the
#                  leader fences gwN and moves the group; gwN hands its stuck writes back;
#                  nsid N optimized on one survivor only; healed: failback; zero errors;
#                  gwN's log names the OSD
#   osd-cut-pauses   median and max of the OSD-cut pauses (printed; fails over 10 s)
#   fence-cut      as fence below, with gwN's link taken down instead of SIGSTOP: once the
#                  link is back, the host's python client's write through gwN fails
#   leader-kill    kill -9 of the leading nvmeof-control replica: the other takes over
#   failover-after-leader-kill   one more failover round, led by the surviving replica
#   fence          under fio: gw1 frozen (SIGSTOP) past the grace, fenced, thawed (SIGCONT):
#                  the host's python client writes through gw1 and fails, `rbd export` and a
#                  read here show the block intact; nsid 1 ends with exactly one optimized
#                  path (the survivor's, or gw1's if the control plane fails back to it with
#                  fresh clients); zero fio/probe errors; gw1 restarted: failback
#   restart-all    every gateway and replica killed and restarted (configuration from RADOS):
#                  nvmeofctl lists unchanged (host side), every path live again here, one
#                  optimized path per namespace, the data of step `data` read back, fio verify
#   final-data     `rbd export` still equals the data of step `data`
#   disconnect     nvme disconnect
# Lines "PAUSE ..." carry the measured pauses. Last line: "N passed, N failed".
set -u
export LC_ALL=C

SH=${1:?usage: e2e-group-guest.sh SHARED_DIR ROUNDS PORT1,PORT2}
ROUNDS=${2:?usage}
IFS=, read -r -a PORTS <<< "${3:?usage}"
SIG=$SH/sig
ADDR=10.0.2.2
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-group
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2e09000-0000-4000-8000-000000000001
HOSTID=e2e09000-0000-4000-8000-000000000001
NGW=${#PORTS[@]}
IMAGES=(); for _i in $(seq "$NGW"); do IMAGES+=("e2e-g$_i"); done
MIB=1048576
DATA_OFF_MIB=100       # step data: 8 MiB here on every namespace
PROBE_OFF_MIB=200      # the probe's 1 MiB ring
FENCE_LBA=$((240 * MIB / 512))  # the fenced gateway's write goes here (nsid 1, or N for fence-cut)
NETCUT_GW=$(cat "$SH/netcut" 2>/dev/null)  # the gateway the host can cut off (E2E_NETCUT=1)
CUT_ROUNDS=3
PART_ROUNDS=2
CEPH_CUT_ROUNDS=2
OSD_CUT_ROUNDS=2
FIO_RATE=200
FIO_MIB=12            # per round: 3072 4K writes at FIO_RATE, ~15 s, then their verify
WORK=/tmp/e2e-group
mkdir -p "$WORK"
LOGDIR=$SH/guest
mkdir -p "$LOGDIR"
# --ctrl-loss-tmo: a killed gateway's path keeps reconnecting (every second) until it is back;
# --keep-alive-tmo=1: a frozen gateway (its connections open, nothing answered) is given up by
# the host within 1-1.5 s (the kernel sends a keep-alive every KATO/2 and waits KATO for it),
# where the kernel's default of 5 s held writes up to ~7 s whatever the control plane did
KATO=1
COPTS=(-t tcp -a "$ADDR" --ctrl-loss-tmo=600 --reconnect-delay=1 --keep-alive-tmo=$KATO --hostnqn="$HOSTNQN" --hostid="$HOSTID")
FREEZE_ROUNDS=3

. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"  # ask
. "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh"
on_step_failure() { dmesg | grep -iE 'nvme' | tail -n 6 | sed 's/^/    dmesg: /'; }


# ------------------------------------------------------------- multipath --
# Polled while the pause is measured: bash builtins only (no fork, no exec), so that the
# polling does not take the guest's CPU from the I/O being measured.
cs_now() { local u _r; read -r u _r < /proc/uptime; CS=$(( ${u%.*} * 100 + 10#${u#*.} )); }  # sets CS (1/100 s)
subsys_dir() {
  local s n
  for s in /sys/class/nvme-subsystem/nvme-subsys*; do
    n=""; read -r n < "$s/subsysnqn" 2>/dev/null
    [ "$n" = "$NQN" ] && { echo "$s"; return 0; }
  done
  return 1
}
head_dev() { # NSID: the multipath head's block device
  local s n b id
  s=$(subsys_dir) || return 1
  for n in "$s"/nvme*n*; do
    b=${n##*/}
    case $b in *c*n*) continue ;; esac
    id=""; read -r id < "/sys/block/$b/nsid" 2>/dev/null
    [ "$id" = "$1" ] && [ -b "/dev/$b" ] && { echo "/dev/$b"; return 0; }
  done
  return 1
}
gw_of_ctrl() { # nvmeC: the gateway (gwN) from the controller's trsvcid; sets GW
  local a="" p i
  read -r a < "/sys/class/nvme/$1/address" 2>/dev/null
  p=${a#*trsvcid=}; p=${p%%,*}
  GW="gw?"
  for i in "${!PORTS[@]}"; do [ "${PORTS[$i]}" = "$p" ] && GW=gw$((i + 1)); done
}
declare -A HEADS=()
# path_scan NSID: PATHS_OUT = one "gwN ctrl-state ana-state pathdev" per path; OPT = the
# gateways with a live optimized path (space-separated)
path_scan() {
  local h p b c st ana
  PATHS_OUT=() OPT=""
  h=${HEADS[$1]:-}
  if [ -z "$h" ]; then h=$(head_dev "$1") || return 1; HEADS[$1]=$h; fi
  h=${h#/dev/nvme}  # S n H
  for p in /sys/block/nvme"${h%%n*}"c*n"${h#*n}"; do
    [ -e "$p" ] || continue
    b=${p##*/}; c=${b#nvme*c}; c=nvme${c%%n*}
    st="" ana=""
    read -r st < "/sys/class/nvme/$c/state" 2>/dev/null
    read -r ana < "$p/ana_state" 2>/dev/null
    gw_of_ctrl "$c"
    PATHS_OUT+=("$GW $st $ana $b")
    [ "$st" = live ] && [ "$ana" = optimized ] && OPT+=${OPT:+ }$GW
  done
  return 0
}
paths() { path_scan "$1" || return 1; printf '%s\n' "${PATHS_OUT[@]}"; }
optimized_on() { path_scan "$1"; echo "$OPT"; }
wait_optimized() { # NSID gwN SECONDS: until nsid is optimized on gwN and nowhere else
  local end; cs_now; end=$((CS + $3 * 100))
  while :; do
    path_scan "$1" && [ "$OPT" = "$2" ] && return 0
    cs_now; [ "$CS" -gt "$end" ] && return 1
    sleep 0.1
  done
}
wait_moved() { # NSID gwN SECONDS: until nsid is optimized on exactly one gateway, not gwN; sets SURVIVOR
  local end; cs_now; end=$((CS + $3 * 100))
  while :; do
    path_scan "$1" && [[ -n $OPT && $OPT != *" "* && $OPT != "$2" ]] && { SURVIVOR=$OPT; return 0; }
    cs_now; [ "$CS" -gt "$end" ] && return 1
    sleep 0.1
  done
}
show_paths() { local n; for n in $(seq $NGW); do path_scan "$n"; say "nsid $n: $(printf '%s;' "${PATHS_OUT[@]}")"; done; }

# ------------------------------------------------------------------ steps --
discover() { discover_on_ports "${PORTS[0]}" "$(IFS=,; echo "${PORTS[*]}")"; }

connect_all() {
  local i out n
  for i in "${!PORTS[@]}"; do
    out=$(timeout -k 5 90 nvme connect "${COPTS[@]}" -s "${PORTS[$i]}" -n "$NQN" 2>&1) ||
      { say "nvme connect to gw$((i + 1)) (port ${PORTS[$i]}) failed: $out"; return 1; }
    say "gw$((i + 1)) (10.0.2.2:${PORTS[$i]}): ${out:-connected}"
  done
  for n in $(seq $NGW); do
    for _ in $(seq 200); do [ "$(paths "$n" 2>/dev/null | wc -l)" -eq $NGW ] && break; sleep 0.1; done
    [ "$(paths "$n" | wc -l)" -eq $NGW ] || { say "nsid $n: $(paths "$n" | wc -l) path(s), expected $NGW"; show_paths; return 1; }
  done
  local c
  for c in /sys/class/nvme/nvme*; do
    [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
    gw_of_ctrl "${c##*/}"
    say "${c##*/}: $GW cntlid $(cat "$c/cntlid") state $(cat "$c/state")"
  done
  for n in $(seq $NGW); do say "nsid $n: head $(head_dev "$n"), $(( $(cat "/sys/block/$(basename "$(head_dev "$n")")/size") / 2048 )) MiB"; done
}

ana_check() {
  local n ok=0
  for n in $(seq $NGW); do
    wait_optimized "$n" "gw$n" 20 || ok=1
  done
  show_paths
  nvme list-subsys "$(head_dev 1)" 2>&1 | sed 's/^/    | /'
  for n in $(seq $NGW); do
    [ "$(optimized_on "$n")" = "gw$n" ] || { say "nsid $n: optimized on '$(optimized_on "$n")', expected exactly gw$n"; ok=1; }
    [ "$(paths "$n" | awk '$3 == "optimized"' | wc -l)" -eq 1 ] || { say "nsid $n: not exactly one optimized path"; ok=1; }
  done
  return $ok
}

data_write() {
  local n d
  for n in $(seq $NGW); do
    d=$(head_dev "$n") || return 1
    head -c $((8 * MIB)) /dev/urandom > "$SH/data$n.bin" || return 1
    timeout -k 5 120 dd if="$SH/data$n.bin" of="$d" bs=1M seek=$DATA_OFF_MIB oflag=direct conv=fsync status=none ||
      { say "dd to nsid $n failed"; return 1; }
    ask 120 check "${IMAGES[$((n - 1))]}" cmp $((DATA_OFF_MIB * MIB)) "data$n.bin" || return 1
  done
}
data_read_back() {
  local n d
  for n in $(seq $NGW); do
    d=$(head_dev "$n") || return 1
    timeout -k 5 120 dd if="$d" bs=1M skip=$DATA_OFF_MIB count=8 iflag=direct status=none | cmp - "$SH/data$n.bin" ||
      { say "nsid $n: the 8 MiB at $DATA_OFF_MIB MiB read back differ"; return 1; }
  done
  say "the 8 MiB of every namespace read back identical"
}
final_data() {
  local n
  for n in $(seq $NGW); do ask 120 check "${IMAGES[$((n - 1))]}" cmp $((DATA_OFF_MIB * MIB)) "data$n.bin" || return 1; done
}

# ---- load: fio verify + the pause probe (shared with the other failover test) --
. "$(dirname "${BASH_SOURCE[0]}")/guest-load.sh"

FAILOVER_PAUSES=() FAILBACK_PAUSES=() SURVIVOR=""
failover_round() { # NAME: kill -9 gw1 under load, failback after its restart
  local name=$1 tk tr topt tback pf pb ok=0
  wait_optimized 1 gw1 30 || { say "nsid 1 is not optimized on gw1 only before the round"; show_paths; return 1; }
  load_start "$name" 1 || return 1
  tk=$(now)
  ask 30 kill-gw 1 || ok=1
  if wait_moved 1 gw1 30; then topt=$(since "$tk"); say "nsid 1 optimized on $SURVIVOR only ${topt}s after the kill request"
  else say "nsid 1 not optimized on exactly one survivor within 30 s"; show_paths; ok=1; fi
  sleep 2
  tr=$(now)
  ask 60 start-gw 1 || ok=1
  if wait_optimized 1 gw1 60; then tback=$(since "$tr"); say "failback: nsid 1 optimized on gw1 only ${tback}s after the restart request"
  else say "no failback to gw1 within 60 s"; show_paths; ok=1; fi
  sleep 1
  load_finish || ok=1
  pf=$(gap "$tk" "$tr"); pb=$(gap "$tr" 1e9)
  FAILOVER_PAUSES+=("$pf"); FAILBACK_PAUSES+=("$pb")
  echo "PAUSE $name: kill -9 of gw1 -> writes resumed: ${pf}s; restart -> failback pause ${pb}s (fio max write latency ${FIO_CLAT_MAX_MS} ms over the round)"
  local r; r=$(dmesg | grep -ciE 'I/O error|blk_update_request|Buffer I/O')
  [ "$r" -eq 0 ] || { say "dmesg has $r I/O error line(s)"; dmesg | grep -iE 'I/O error|blk_update_request|Buffer I/O' | tail -n 5 | sed 's/^/    dmesg: /'; ok=1; }
  return $ok
}

stats() { # values...: "median M max X" (sorted, median of an even count = the upper middle)
  printf '%s\n' "$@" | sort -n | awk '{v[NR] = $1} END { if (NR) printf "median %.2f s, max %.2f s, all:", v[int(NR / 2) + 1], v[NR]; for (i = 1; i <= NR; i++) printf " %s", v[i] }'
}
pauses() {
  [ ${#FAILOVER_PAUSES[@]} -gt 0 ] || { say "no round measured"; return 1; }
  echo "PAUSE kill -9 failover over ${#FAILOVER_PAUSES[@]} run(s): $(stats "${FAILOVER_PAUSES[@]}") (goal <= 1 s; the step fails over 3 s)"
  echo "PAUSE failback over ${#FAILBACK_PAUSES[@]} run(s): $(stats "${FAILBACK_PAUSES[@]}")"
  local med; med=$(printf '%s\n' "${FAILOVER_PAUSES[@]}" | sort -n | awk '{v[NR] = $1} END {print v[int(NR / 2) + 1]}')
  awk -v m="$med" 'BEGIN{exit !(m <= 3.0)}' || { say "median failover pause ${med}s > 3 s"; return 1; }
}

# outage_round NAME N STOP BACK WHAT: gwN made silent under load without a connection reset
# (SIGSTOP, or its network cut): the control plane sees missed beacons, the host a
# keep-alive timeout; writes resume through the survivor while gwN is still silent; back,
# gwN is fenced, drops its blocklisted clients and gets the group back through fresh ones
# (failback). Sets OUTAGE_PAUSE.
OUTAGE_PAUSE=""
outage_round() {
  local name=$1 n=$2 stop=$3 back=$4 what=$5 tk tt ok=0
  wait_optimized "$n" "gw$n" 30 || { say "nsid $n is not optimized on gw$n only before the round"; show_paths; return 1; }
  load_start "$name" "$n" || return 1
  tk=$(now)
  ask 30 "$stop" "$n" || ok=1
  if wait_moved "$n" "gw$n" 30; then say "nsid $n optimized on $SURVIVOR only $(since "$tk")s after the $what request (host keep-alive timeout ${KATO} s)"
  else say "nsid $n not optimized on exactly one survivor within 30 s of the $what"; show_paths; ok=1; fi
  sleep 1
  tt=$(now)
  ask 30 "$back" "$n" || ok=1
  if wait_optimized "$n" "gw$n" 60; then say "failback: nsid $n optimized on gw$n only $(since "$tt")s after it came back"
  else say "no failback to gw$n within 60 s"; show_paths; ok=1; fi
  sleep 1
  load_finish || ok=1
  OUTAGE_PAUSE=$(gap "$tk" "$tt")
  echo "PAUSE $name: $what of gw$n -> writes resumed: ${OUTAGE_PAUSE}s; back -> failback pause $(gap "$tt" 1e9)s (fio max write latency ${FIO_CLAT_MAX_MS} ms over the round)"
  local r; r=$(dmesg | grep -ciE 'I/O error|blk_update_request|Buffer I/O')
  [ "$r" -eq 0 ] || { say "dmesg has $r I/O error line(s)"; ok=1; }
  return $ok
}
FREEZE_PAUSES=() CUT_PAUSES=()
freeze_round() { # NAME
  local rc; OUTAGE_PAUSE=""
  outage_round "$1" 1 freeze-gw thaw-gw SIGSTOP; rc=$?
  [ -n "$OUTAGE_PAUSE" ] && FREEZE_PAUSES+=("$OUTAGE_PAUSE")
  return $rc
}
cut_round() { # NAME
  local rc; OUTAGE_PAUSE=""
  outage_round "$1" "$NETCUT_GW" cut-gw restore-gw "network cut"; rc=$?
  [ -n "$OUTAGE_PAUSE" ] && CUT_PAUSES+=("$OUTAGE_PAUSE")
  return $rc
}
PART_PAUSES=()
part_round() { # NAME
  local rc; OUTAGE_PAUSE=""
  outage_round "$1" "$NETCUT_GW" partition-gw heal-gw "partition from Ceph and the control plane"; rc=$?
  [ -n "$OUTAGE_PAUSE" ] && PART_PAUSES+=("$OUTAGE_PAUSE")
  return $rc
}
CEPH_CUT_PAUSES=()
ceph_cut_round() { # NAME
  local rc; OUTAGE_PAUSE=""
  outage_round "$1" "$NETCUT_GW" ceph-cut-gw ceph-heal-gw "cut from Ceph only"; rc=$?
  [ -n "$OUTAGE_PAUSE" ] && CEPH_CUT_PAUSES+=("$OUTAGE_PAUSE")
  return $rc
}
# handed_back_pauses WHAT NOTE PAUSE...: the pauses' median and max, printed; over 10 s the
# writes stuck on gwN waited for this host's I/O timeout (30 s): gwN did not hand them back
# when the group moved away, and the step fails.
handed_back_pauses() {
  local what=$1 note=$2 max; shift 2
  [ $# -gt 0 ] || { say "no $what round measured"; return 1; }
  echo "PAUSE $what failover over $# run(s): $(stats "$@") (${note}the step fails over 10 s)"
  max=$(printf '%s\n' "$@" | sort -n | tail -n 1)
  awk -v m="$max" 'BEGIN{exit !(m <= 10.0)}' || { say "a $what pause of ${max}s: stuck writes were not handed back"; return 1; }
}
ceph_cut_pauses() { handed_back_pauses Ceph-cut "goal <= 3 s; " "${CEPH_CUT_PAUSES[@]}"; }
OSD_CUT_PAUSES=()
osd_cut_round() { # NAME
  local rc; OUTAGE_PAUSE=""
  outage_round "$1" "$NETCUT_GW" osd-cut-gw osd-heal-gw "cut from the OSD only"; rc=$?
  [ -n "$OUTAGE_PAUSE" ] && OSD_CUT_PAUSES+=("$OUTAGE_PAUSE")
  return $rc
}
osd_cut_pauses() { handed_back_pauses OSD-cut "" "${OSD_CUT_PAUSES[@]}"; }
part_pauses() {
  [ ${#PART_PAUSES[@]} -gt 0 ] || { say "no partition round measured"; return 1; }
  echo "PAUSE partition failover over ${#PART_PAUSES[@]} run(s): $(stats "${PART_PAUSES[@]}") (goal <= 3 s)"
}
cut_pauses() {
  [ ${#CUT_PAUSES[@]} -gt 0 ] || { say "no network-cut round measured"; return 1; }
  echo "PAUSE network-cut failover over ${#CUT_PAUSES[@]} run(s): $(stats "${CUT_PAUSES[@]}") (goal <= 3 s)"
}
freeze_pauses() {
  [ ${#FREEZE_PAUSES[@]} -gt 0 ] || { say "no freeze round measured"; return 1; }
  echo "PAUSE SIGSTOP failover over ${#FREEZE_PAUSES[@]} run(s): $(stats "${FREEZE_PAUSES[@]}") (goal <= 3 s)"
}

leader_kill() { ask 60 kill-leader; }

fence() { # [N HOW]: gwN (default 1) silenced past the grace by HOW (freeze, or cut: its link)
  local n=${1:-1} how=${2:-freeze} ok=0 tf d
  wait_optimized "$n" "gw$n" 30 || { say "nsid $n is not optimized on gw$n only before the step"; show_paths; return 1; }
  load_start "fence-$how" "$n" || return 1
  tf=$(now)
  ask 120 fence-cycle "$n" "$n" $FENCE_LBA "$how" || ok=1
  # Then nsid 1 must settle on exactly one optimized path: the survivor's, or gw1's again if
  # the control plane failed back to it (a thawed gateway drops its blocklisted clients and
  # may be given the group back through fresh ones, after the survivor is drained and fenced)
  local one=""
  for _ in $(seq 400); do
    path_scan "$n"
    [[ -n $OPT && $OPT != *" "* ]] && { one=$OPT; break; }
    sleep 0.1
  done
  show_paths
  if [ -z "$one" ]; then say "nsid $n has no single optimized path 40 s after gw$n came back: '$OPT'"; ok=1
  elif [ "$one" = "gw$n" ]; then say "nsid $n optimized on gw$n only again: the control plane failed back to it (fresh clients)"
  else say "nsid $n optimized on $one only (the survivor)"; fi
  load_finish || ok=1
  echo "PAUSE fence-$how ($how of gw$n; the host waits for the silent path's answers, up to its keep-alive timeout): writes paused $(gap "$tf" 1e9)s (fio max write latency ${FIO_CLAT_MAX_MS} ms)"
  d=$(head_dev "$n")
  timeout -k 5 60 dd if="$d" bs=512 skip=$FENCE_LBA count=1 iflag=direct status=none | cmp - "$SH/fence-a5.bin" ||
    { say "the block at LBA $FENCE_LBA does not read 0xA5 through the survivor"; ok=1; }
  [ $ok = 0 ] && say "LBA $FENCE_LBA reads 0xA5 here (through ${one:-?}): the fenced gateway's 0x5A did not land"
  # a fresh start of gwN for the next steps, and its failback
  ask 30 kill-gw "$n" && ask 60 start-gw "$n" || ok=1
  wait_optimized "$n" "gw$n" 60 || { say "no failback to the restarted gw$n"; show_paths; ok=1; }
  return $ok
}

restart_all() {
  local ok=0 t0 n
  t0=$(now)
  ask 180 restart-all || ok=1
  for n in $(seq $NGW); do
    wait_optimized "$n" "gw$n" 60 || { say "nsid $n not optimized on gw$n only"; ok=1; }
  done
  for _ in $(seq 300); do [ "$(paths 1 | awk '$2 == "live"' | wc -l)" -eq $NGW ] && break; sleep 0.1; done
  show_paths
  say "every path live and one optimized per namespace $(since "$t0")s after the restart request"
  data_read_back || ok=1
  local d out; d=$(head_dev 2)
  out=$(cd /tmp && timeout -k 10 120 fio --name=after --filename="$d" --direct=1 --ioengine=libaio --rw=randwrite \
    --bs=4k --offset=32M --size=4M --iodepth=4 --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 2>&1) ||
    { say "fio verify on nsid 2 failed: $(echo "$out" | tail -n 5)"; ok=1; }
  [ $ok = 0 ] && say "fio verify 4 MiB on nsid 2: ok"
  return $ok
}

disconnect() {
  timeout -k 5 60 nvme disconnect -n "$NQN" 2>&1 | sed 's/^/    /'
  subsys_dir >/dev/null && [ -n "$(ls -d "$(subsys_dir)"/nvme[0-9]* 2>/dev/null)" ] && { say "controllers left"; return 1; }
  return 0
}

cleanup() {
  [ -n "$FIO_PID" ] && kill "$FIO_PID" 2>/dev/null
  [ -n "$PROBE_PID" ] && kill "$PROBE_PID" 2>/dev/null
  delete_ctrls "$NQN"
  dmesg > "$LOGDIR/dmesg.log" 2>/dev/null
}
trap cleanup EXIT

# ------------------------------------------------------------------ main --
echo "e2e-group-guest: guest $(uname -r), $(nproc) vCPU, nvme-cli $(nvme version 2>/dev/null | head -1 | awk '{print $3}'), gateways at $ADDR:${PORTS[*]}"
LATER=(data failover pauses freeze freeze-pauses leader-kill failover-after-leader-kill fence restart-all final-data disconnect)
if step setup "load nvme-tcp; native multipath on" multipath_setup "iopolicy default numa" &&
   step discover "nvme discover via gw1: the subsystem on every gateway's port" discover &&
   step connect "nvme connect to the $NGW gateways: one head per namespace, $NGW paths each" connect_all; then
  step ana "one optimized path per namespace, on its ANA group's owner" ana_check
  step data "8 MiB random per namespace, equal in rbd export" data_write
  for k in $(seq "$ROUNDS"); do
    step "failover-$k" "kill -9 gw1 under fio verify + probe; optimized on one survivor; restart; failback; zero errors" failover_round "failover-$k"
  done
  step pauses "failover pause over the rounds: median <= 3 s" pauses
  for k in $(seq "$FREEZE_ROUNDS"); do
    step "freeze-$k" "SIGSTOP gw1 under fio verify + probe; optimized on one survivor; thaw; failback; zero errors" freeze_round "freeze-$k"
  done
  step freeze-pauses "SIGSTOP failover pause over the rounds (printed)" freeze_pauses
  if [ -n "$NETCUT_GW" ]; then
    for k in $(seq "$CUT_ROUNDS"); do
      step "cut-$k" "gw$NETCUT_GW's link down under fio verify + probe; optimized on one survivor; link up; failback; zero errors" cut_round "cut-$k"
    done
    step cut-pauses "network-cut failover pause over the rounds (printed)" cut_pauses
    for k in $(seq "$PART_ROUNDS"); do
      step "part-$k" "gw$NETCUT_GW cut from Ceph and the control plane, not from this host, under fio verify + probe: it demotes itself; optimized on one survivor; healed; failback; zero errors" part_round "part-$k"
    done
    step part-pauses "partition failover pause over the rounds (printed)" part_pauses
    for k in $(seq "$CEPH_CUT_ROUNDS"); do
      step "ceph-cut-$k" "gw$NETCUT_GW cut from Ceph only (still beaconing, still reached by this host) under fio verify + probe: it reports the stall; optimized on one survivor; healed; failback; zero errors" ceph_cut_round "ceph-cut-$k"
    done
    step ceph-cut-pauses "Ceph-cut failover pause over the rounds (printed)" ceph_cut_pauses
    for k in $(seq "$OSD_CUT_ROUNDS"); do
      step "osd-cut-$k" "gw$NETCUT_GW cut from the OSD only (the monitor and the control plane still answering it) under fio verify + probe: it names the OSD, which answers the leader; optimized on one survivor; healed; failback; zero errors" osd_cut_round "osd-cut-$k"
    done
    step osd-cut-pauses "OSD-cut failover pause over the rounds (printed)" osd_cut_pauses
    step fence-cut "gw$NETCUT_GW's link down past the grace, up again: its write fails, data intact, one optimized path" fence "$NETCUT_GW" cut
  fi
  if step leader-kill "kill -9 of the leading nvmeof-control replica: the other leads" leader_kill; then
    step failover-after-leader-kill "a failover led by the surviving replica" failover_round failover-after-leader-kill
  else skip failover-after-leader-kill "leader-kill failed"; fi
  step fence "SIGSTOP gw1 past the grace, SIGCONT: its write fails, data intact, one optimized path" fence
  step restart-all "every gateway and replica restarted: config from RADOS, paths back, data intact" restart_all
  step final-data "rbd export still equals the data written at the start" final_data
  step disconnect "nvme disconnect" disconnect
else
  for s in ana "${LATER[@]}"; do skip "$s" "connect failed"; done
fi
cleanup; trap - EXIT

guest_summary "e2e-group guest summary (guest $(uname -r), TCG)"
[ $FAIL -eq 0 ]
