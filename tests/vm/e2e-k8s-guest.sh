#!/bin/bash
# e2e-k8s-guest.sh - the in-guest half of tests/vm/e2e-k8s.sh (run by it through
# tests/vm/run-in-vm.sh; not meant to be run by hand):
#
#   e2e-k8s-guest.sh SHARED_DIR SUBNET IP0,IP1
#
# The gateway pods run as containers on the host's docker network SUBNET, gateway-N at IPn
# port 4420 (gateway-N owns ANA group N+1 = nsid N+1). The guest routes SUBNET via the QEMU
# user network's gateway 10.0.2.2 (slirp makes the connections from the host, which reaches
# the bridge) and connects with the real Linux initiator and native NVMe multipath. It asks the
# host to act through request files in SHARED_DIR/sig (see e2e-k8s.sh).
# Steps (each timed, PASS/FAIL):
#   setup        nvme-tcp, native multipath, the route to the pod network
#   connect      nvme connect to every gateway pod: one multipath head per namespace, a path each
#   ana          per namespace exactly one optimized path, on its ANA group's owner
#   data         4 MiB of random data per namespace, equal in `rbd export`
#   kill         under fio --verify=crc32c (4K randwrite QD4) and a write probe on nsid 1:
#                `docker kill` of gateway-0; nsid 1 optimized on gateway-1; gateway-0 recreated
#                (ready); failback; zero fio, verify and probe errors; PAUSE printed
#   roll-N       (N = 0, 1) one rolling-update step under the same load on nsid N+1: gateway-N
#                deleted (SIGTERM, its grace period: the planned leave hands its group to the
#                peer), recreated, ready, failback; zero errors; PAUSE of the planned move printed
#   cp-kill      the leading control-plane replica killed (`docker kill`): the other leads
#   kill-after-cp-kill   the `kill` round again, led by the surviving replica; then the
#                killed replica is recreated
#   final-data   `rbd export` still equals the data of step `data`
#   disconnect   nvme disconnect
# Lines "PAUSE ..." carry the measured pauses. Last line: "N passed, N failed".
set -u
export LC_ALL=C

SH=${1:?usage: e2e-k8s-guest.sh SHARED_DIR SUBNET IP0,IP1}
SUBNET=${2:?usage}
IFS=, read -r -a IPS <<< "${3:?usage}"
SIG=$SH/sig
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-k8s
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2e24000-0000-4000-8000-000000000001
HOSTID=e2e24000-0000-4000-8000-000000000001
NGW=${#IPS[@]}
IMAGES=(); for _i in $(seq "$NGW"); do IMAGES+=("e2e-k8s-$_i"); done
MIB=1048576
DATA_OFF_MIB=100       # step data: 4 MiB here on every namespace
PROBE_OFF_MIB=200      # the probe's 1 MiB ring
FIO_RATE=200
FIO_MIB=8              # per round: 2048 4K writes at FIO_RATE, ~10 s, then their verify
WORK=/tmp/e2e-k8s
mkdir -p "$WORK"
LOGDIR=$SH/guest
mkdir -p "$LOGDIR"
# --ctrl-loss-tmo: a killed gateway's path keeps reconnecting (every second) until it is back
COPTS=(-t tcp -s 4420 --ctrl-loss-tmo=600 --reconnect-delay=1 --hostnqn="$HOSTNQN" --hostid="$HOSTID")

. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"  # ask
. "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh"
on_step_failure() { dmesg | grep -iE 'nvme' | tail -n 6 | sed 's/^/    dmesg: /'; }

# The multipath helpers and the load (fio verify + the pause probe) below are those of
# e2e-group-guest.sh, with paths told apart by the gateway's address instead of its port.
# Polled while the pause is measured: bash builtins only (no fork, no exec), so that the
# polling does not take the guest's CPU from the I/O being measured.
cs_now() { local u _r; read -r u _r < /proc/uptime; CS=$(( ${u%.*} * 100 + 10#${u#*.} )); }  # sets CS (1/100 s)
subsys_dir() {
  local s n
  for s in /sys/class/nvme-subsystem/nvme-subsys*; do
    [ -e "$s/subsysnqn" ] || continue  # no subsystem left (after the disconnect)
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
gw_of_ctrl() { # nvmeC: the gateway pod (gwN = gateway-N) from the controller's traddr; sets GW
  local a="" p i
  read -r a < "/sys/class/nvme/$1/address" 2>/dev/null
  p=${a#*traddr=}; p=${p%%,*}
  GW="gw?"
  for i in "${!IPS[@]}"; do [ "${IPS[$i]}" = "$p" ] && GW=gw$i; done
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

# ---- load: fio verify + the pause probe (shared with the other failover test) --
. "$(dirname "${BASH_SOURCE[0]}")/guest-load.sh"


# ------------------------------------------------------------------ steps --
route_setup() {
  multipath_setup "iopolicy default numa" || return 1
  ip route replace "$SUBNET" via 10.0.2.2 dev eth0 || return 1
  say "route: $(ip route show "$SUBNET")"
}

connect_all() {
  local i out n c
  for i in "${!IPS[@]}"; do
    out=$(timeout -k 5 90 nvme connect "${COPTS[@]}" -a "${IPS[$i]}" -n "$NQN" 2>&1) ||
      { say "nvme connect to gateway-$i (${IPS[$i]}:4420) failed: $out"; return 1; }
    say "gateway-$i (${IPS[$i]}:4420): ${out:-connected}"
  done
  for n in $(seq $NGW); do
    for _ in $(seq 200); do [ "$(paths "$n" 2>/dev/null | wc -l)" -eq $NGW ] && break; sleep 0.1; done
    [ "$(paths "$n" | wc -l)" -eq $NGW ] || { say "nsid $n: $(paths "$n" | wc -l) path(s), expected $NGW"; show_paths; return 1; }
  done
  for c in /sys/class/nvme/nvme*; do
    [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
    gw_of_ctrl "${c##*/}"
    say "${c##*/}: $GW cntlid $(cat "$c/cntlid") state $(cat "$c/state") $(cat "$c/address")"
  done
}

ana_check() {
  local n ok=0
  for n in $(seq $NGW); do wait_optimized "$n" "gw$((n - 1))" 20 || ok=1; done
  show_paths
  for n in $(seq $NGW); do
    [ "$(optimized_on "$n")" = "gw$((n - 1))" ] || { say "nsid $n: optimized on '$(optimized_on "$n")', expected exactly gw$((n - 1))"; ok=1; }
  done
  return $ok
}

data_write() {
  local n d
  for n in $(seq $NGW); do
    d=$(head_dev "$n") || return 1
    head -c $((4 * MIB)) /dev/urandom > "$SH/data$n.bin" || return 1
    timeout -k 5 120 dd if="$SH/data$n.bin" of="$d" bs=1M seek=$DATA_OFF_MIB oflag=direct conv=fsync status=none ||
      { say "dd to nsid $n failed"; return 1; }
    ask 120 check "${IMAGES[$((n - 1))]}" cmp $((DATA_OFF_MIB * MIB)) "data$n.bin" || return 1
  done
}
final_data() {
  local n
  for n in $(seq $NGW); do ask 120 check "${IMAGES[$((n - 1))]}" cmp $((DATA_OFF_MIB * MIB)) "data$n.bin" || return 1; done
}

dmesg_clean() {
  local r; r=$(dmesg | grep -ciE 'I/O error|blk_update_request|Buffer I/O')
  [ "$r" -eq 0 ] && return 0
  say "dmesg has $r I/O error line(s)"; dmesg | grep -iE 'I/O error|blk_update_request|Buffer I/O' | tail -n 5 | sed 's/^/    dmesg: /'
  return 1
}

# kill_round NAME: docker kill of gateway-0 under load on nsid 1, recreated, failback
kill_round() {
  local name=$1 tk tr ok=0 pf pb
  wait_optimized 1 gw0 30 || { say "nsid 1 is not optimized on gateway-0 only before the round"; show_paths; return 1; }
  load_start "$name" 1 || return 1
  tk=$(now)
  ask 30 kill-gw 0 || ok=1
  if wait_moved 1 gw0 30; then say "nsid 1 optimized on $SURVIVOR only $(since "$tk")s after the kill request"
  else say "nsid 1 not optimized on exactly one survivor within 30 s"; show_paths; ok=1; fi
  sleep 1
  tr=$(now)
  ask 90 start-gw 0 || ok=1
  if wait_optimized 1 gw0 60; then say "failback: nsid 1 optimized on gateway-0 only $(since "$tr")s after the recreate request"
  else say "no failback to gateway-0 within 60 s"; show_paths; ok=1; fi
  sleep 1
  load_finish || ok=1
  pf=$(gap "$tk" "$tr"); pb=$(gap "$tr" 1e9)
  echo "PAUSE $name: docker kill of gateway-0 -> writes resumed: ${pf}s; recreated pod -> failback pause ${pb}s (fio max write latency ${FIO_CLAT_MAX_MS} ms)"
  dmesg_clean || ok=1
  return $ok
}

# roll_round N: a rolling-update step of gateway-N under load on the namespace it owns
roll_round() {
  local n=$1 nsid=$(($1 + 1)) ts ok=0 pm pb
  wait_optimized "$nsid" "gw$n" 30 || { say "nsid $nsid is not optimized on gateway-$n only before the step"; show_paths; return 1; }
  load_start "roll-$n" "$nsid" || return 1
  ts=$(now)
  # the answer comes once the recreated pod is ready: the planned move happened meanwhile
  ask 120 roll-gw "$n" || ok=1
  local tr; tr=$(now)
  if wait_optimized "$nsid" "gw$n" 60; then say "nsid $nsid optimized on gateway-$n only again $(since "$tr")s after it was ready"
  else say "no failback to gateway-$n within 60 s"; show_paths; ok=1; fi
  sleep 1
  load_finish || ok=1
  pm=$(gap "$ts" "$tr"); pb=$(gap "$tr" 1e9)
  echo "PAUSE roll-$n: planned move of ANA group $nsid (SIGTERM of gateway-$n, grace period) -> writes paused at most ${pm}s; failback to the recreated pod ${pb}s (fio max write latency ${FIO_CLAT_MAX_MS} ms)"
  dmesg_clean || ok=1
  return $ok
}

cp_kill() { ask 60 kill-cp-leader; }
kill_after_cp_kill() {
  local ok=0
  kill_round kill-after-cp-kill || ok=1
  ask 90 start-cp || ok=1
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
echo "e2e-k8s-guest: guest $(uname -r), $(nproc) vCPU, gateway pods at ${IPS[*]} (port 4420), pod network $SUBNET"
LATER=(data kill roll-0 roll-1 cp-kill kill-after-cp-kill final-data disconnect)
if step setup "nvme-tcp, native multipath, route to $SUBNET via 10.0.2.2" route_setup &&
   step connect "nvme connect to the $NGW gateway pods: one head per namespace, $NGW paths each" connect_all; then
  step ana "one optimized path per namespace, on its ANA group's owner" ana_check
  step data "4 MiB random per namespace, equal in rbd export" data_write
  step kill "docker kill of gateway-0 under fio verify + probe; failover; recreated; failback; zero errors" kill_round kill
  for n in $(seq 0 $((NGW - 1))); do
    step "roll-$n" "rolling update of gateway-$n (SIGTERM, grace period; recreated, ready) under fio verify + probe; zero errors" roll_round "$n"
  done
  if step cp-kill "docker kill of the leading control-plane replica: another leads" cp_kill; then
    step kill-after-cp-kill "a failover led by the surviving replica; the killed replica recreated" kill_after_cp_kill
  else skip kill-after-cp-kill "cp-kill failed"; fi
  step final-data "rbd export still equals the data written at the start" final_data
  step disconnect "nvme disconnect" disconnect
else
  for s in ana "${LATER[@]}"; do skip "$s" "connect failed"; done
fi
cleanup; trap - EXIT

guest_summary "e2e-k8s guest summary (guest $(uname -r), TCG)"
[ $FAIL -eq 0 ]
