# shellcheck shell=bash
# tests/vm/tenants/resv.sh - part "resv" of the e2e-tenants stage (sourced by
# tests/vm/e2e-tenants-guest.sh, see its header): NVMe reservations shared by the gateway
# group, with the real Linux host (nvme-cli 2.3 resv-*, 6.1 kernel) as two hosts.
#
# Subsystem $RESV_NQN (any host), one namespace on a fresh 64 MiB image in ANA group 1 (gw1
# owns it). Host A and host B (own host NQN and host ID each) each connect to both gateways:
# four controllers. Every command is aimed at one controller through its character device
# (/dev/nvmeN -n 1: the kernel sends it on that controller's own path, whatever the
# multipath head would pick), so "host B through gw2" means exactly that. Connects are
# written to /dev/nvme-fabrics: nvme-cli 2.3 refuses a second host's connect to the same
# address and port ("already connected", even with --duplicate-connect); the kernel keys
# controllers by host NQN too and accepts it. Steps:
#   resv.setup     rbd-create, nvmeofctl subsystem/listeners/namespace (ANA group 1)
#   resv.connect   A and B on gw1 and gw2: four live controllers; ONCS announces reservations
#   resv.register  through the owner gw1: A and B register; through gw2 (not the owner) a
#                  Register gets ANA Inaccessible (a path error: the host goes to the owner)
#   resv.conflict  A takes Write Exclusive through gw1; B's Acquire and write conflict
#                  through gw1, A writes
#   resv.failover  kill -9 of gw1: through gw2 the report is byte for byte the one before
#                  (generation, type, holder, keys, host IDs); B's write conflicts there too
#   resv.wear      what Windows failover clustering expects of Write Exclusive - All
#                  Registrants: A releases and takes type 5 through gw2; both are holders and
#                  write; B preempts A by key (a node fenced): A's writes conflict, its reads
#                  do not, the reservation stays; A registers again and writes
#   resv.failback  gw1 started again: once group 1 is back on gw1, the report through gw1 is
#                  the one gw2 stored, B writes through gw1
#   resv.cleanup   Clear, disconnect, namespace and subsystem deleted, image removed
RESV_NQN=nqn.2016-06.io.ceph-nvmeof-rs:tenants-resv
RESV_IMAGE=tenants-resv
declare -A RESV_HNQN=(
  [A]=nqn.2014-08.org.nvmexpress:uuid:7e5a0000-0000-4000-8000-00000000000a
  [B]=nqn.2014-08.org.nvmexpress:uuid:7e5a0000-0000-4000-8000-00000000000b)
declare -A RESV_HID=([A]=7e5a0000-0000-4000-8000-00000000000a [B]=7e5a0000-0000-4000-8000-00000000000b)
declare -A RESV_KEY=([A]=a1a1a1a1 [B]=b2b2b2b2)
declare -A RESV_CTRL=()  # [A1] [A2] [B1] [B2]: host A/B's controller on gw1/gw2

resv_nv() { # ARGS...: nvme-cli, output in $WORK/resv.out; its status
  timeout -k 5 30 nvme "$@" > "$WORK/resv.out" 2>&1
}
resv_dev() { echo "/dev/${RESV_CTRL[$1]}"; }  # A1|A2|B1|B2
resv_ok() { # WHAT ARGS...: the nvme-cli command succeeds
  local what=$1; shift
  resv_nv "$@" && return 0
  say "$what failed: $(tr '\n' ' ' < "$WORK/resv.out")"; return 1
}
resv_refused() { # PATTERN WHAT ARGS...: the command fails with a status matching PATTERN
  local pat=$1 what=$2; shift 2
  if resv_nv "$@"; then say "$what succeeded; expected a refusal ($pat)"; return 1; fi
  grep -qiE "$pat" "$WORK/resv.out" && { say "$what: refused as expected: $(grep -iE "$pat" "$WORK/resv.out" | head -1)"; return 0; }
  say "$what failed, but not with $pat: $(tr '\n' ' ' < "$WORK/resv.out")"; return 1
}
RESV_CONFLICT="reservation.conflict|0x4083"
RESV_PATH="inaccessible|0x302"
resv_write() { # CTRL SEED: one 512-byte write to LBA 0 of nsid 1 through that controller
  head -c 512 /dev/zero | tr '\0' "\\$(printf '%03o' "$2")" > "$WORK/resv-blk"
  resv_nv io-passthru "$(resv_dev "$1")" -n 1 --opcode=0x01 --data-len=512 --write \
    --input-file="$WORK/resv-blk"
}
resv_read() { # CTRL
  resv_nv io-passthru "$(resv_dev "$1")" -n 1 --opcode=0x02 --data-len=512 --read
}
resv_report() { # CTRL: the extended report (bytes) in $WORK/resv-report.CTRL, hex on stdout
  timeout -k 5 30 nvme resv-report "$(resv_dev "$1")" -n 1 --eds -b > "$WORK/resv-report.$1" 2> "$WORK/resv.out" ||
    { say "resv-report through $1 failed: $(tr '\n' ' ' < "$WORK/resv.out")"; return 1; }
  od -An -tx1 -v "$WORK/resv-report.$1" | tr -d ' \n' | head -c $(( (64 + 64 * 2) * 2 ))
}
resv_summary() { # HEX of a report: generation, type, registrants
  local h=$1
  say "report: generation 0x${h:6:2}${h:4:2}${h:2:2}${h:0:2}, type ${h:8:2}, registrants ${h:10:2}"
}

resv_setup() {
  ask 60 rbd-create "$RESV_IMAGE" 64 || return 1
  ctl subsystem add --nqn "$RESV_NQN" --allow-any-host || return 1
  ctl listener add -n "$RESV_NQN" -g gw1 -a 127.0.0.1 -p "${PORTS[0]}" || return 1
  ctl listener add -n "$RESV_NQN" -g gw2 -a 127.0.0.1 -p "${PORTS[1]}" || return 1
  ctl namespace add -n "$RESV_NQN" --image "$RESV_IMAGE" --nsid 1 --ana-group 1 || return 1
}
resv_connect_one() { # HOST GW
  local h=$1 g=$2 opts r
  opts="transport=tcp,traddr=$ADDR,trsvcid=${PORTS[$((g - 1))]},nqn=$RESV_NQN,hostnqn=${RESV_HNQN[$h]}"
  opts="$opts,hostid=${RESV_HID[$h]},ctrl_loss_tmo=120,reconnect_delay=1,duplicate_connect"
  r=$(timeout -k 5 60 bash -c 'exec 3<>/dev/nvme-fabrics && printf "%s" "$1" >&3 && read -r -t 50 r <&3 && echo "$r"' _ "$opts" 2>&1) ||
    { say "connect of host $h to gw$g failed: $r"; return 1; }
  r=${r#*instance=}; r=${r%%,*}
  RESV_CTRL[$h$g]=nvme$r
  say "host $h on gw$g: nvme$r ($(cat /sys/class/nvme/nvme$r/address 2>/dev/null))"
}
resv_connect() {
  local h g c i oncs
  for h in A B; do for g in 1 2; do resv_connect_one $h $g || return 1; done; done
  for c in "${RESV_CTRL[@]}"; do  # each controller's path to nsid 1 is there
    for i in $(seq 150); do ls -d /sys/class/nvme/$c/nvme*n1 > /dev/null 2>&1 && break; sleep 0.1; done
    [ "$(cat /sys/class/nvme/$c/state)" = live ] || { say "$c is $(cat /sys/class/nvme/$c/state)"; return 1; }
  done
  resv_ok "id-ctrl" id-ctrl "$(resv_dev A1)" -o json || return 1
  oncs=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["oncs"])' "$WORK/resv.out")
  say "ONCS $oncs"
  (( oncs & 0x20 )) || { say "ONCS bit 5 (reservations) clear on a gateway of the group"; return 1; }
}
resv_register() {
  resv_ok "A's Register through gw1" resv-register "$(resv_dev A1)" -n 1 --nrkey=0x${RESV_KEY[A]} --rrega=0 || return 1
  resv_refused "$RESV_PATH" "B's Register through gw2 (not the owner)" \
    resv-register "$(resv_dev B2)" -n 1 --nrkey=0x${RESV_KEY[B]} --rrega=0 || return 1
  resv_ok "B's Register through gw1" resv-register "$(resv_dev B1)" -n 1 --nrkey=0x${RESV_KEY[B]} --rrega=0 || return 1
  local r; r=$(resv_report A1) || return 1; resv_summary "$r"
  [ "${r:10:2}" = 02 ] || { say "expected 2 registrants"; return 1; }
}
resv_conflict() {
  resv_ok "A's Acquire (Write Exclusive) through gw1" resv-acquire "$(resv_dev A1)" -n 1 \
    --crkey=0x${RESV_KEY[A]} --rtype=1 --racqa=0 || return 1
  resv_refused "$RESV_CONFLICT" "B's Acquire through gw1" resv-acquire "$(resv_dev B1)" -n 1 \
    --crkey=0x${RESV_KEY[B]} --rtype=1 --racqa=0 || return 1
  resv_write B1 11 && { say "B wrote under A's Write Exclusive"; return 1; }
  grep -qiE "$RESV_CONFLICT" "$WORK/resv.out" || { say "B's write: $(cat "$WORK/resv.out")"; return 1; }
  resv_write A1 12 || { say "A's write failed: $(cat "$WORK/resv.out")"; return 1; }
  RESV_BEFORE=$(resv_report A1) || return 1; resv_summary "$RESV_BEFORE"
}
resv_failover() {
  local t0 r=""
  ask 30 kill-gw 1 || return 1
  t0=$(now)
  until r=$(resv_report A2 2> /dev/null) && [ -n "$r" ]; do
    [ "$(since "$t0" | cut -d. -f1)" -lt 40 ] || { say "no report through gw2 within 40 s"; return 1; }
    sleep 0.5
  done
  say "report through gw2 $(since "$t0") s after the kill"; resv_summary "$r"
  [ "$r" = "$RESV_BEFORE" ] || { say "differs from the one through gw1 before the kill:"; say "before $RESV_BEFORE"; say "now    $r"; return 1; }
  resv_write B2 13 && { say "B wrote through gw2 under A's reservation"; return 1; }
  grep -qiE "$RESV_CONFLICT" "$WORK/resv.out" || { say "B's write: $(cat "$WORK/resv.out")"; return 1; }
  resv_write A2 14 || { say "A's write through gw2 failed: $(cat "$WORK/resv.out")"; return 1; }
}
resv_wear() {
  resv_ok "A's Release (Write Exclusive) through gw2" resv-release "$(resv_dev A2)" -n 1 \
    --crkey=0x${RESV_KEY[A]} --rtype=1 --rrela=0 || return 1
  resv_ok "A's Acquire (Write Exclusive - All Registrants)" resv-acquire "$(resv_dev A2)" -n 1 \
    --crkey=0x${RESV_KEY[A]} --rtype=5 --racqa=0 || return 1
  local r; r=$(resv_report B2) || return 1; resv_summary "$r"
  # Both registrants are holders (RCSTS bit 0 of each entry, byte 2).
  [ "${r:8:2}" = 05 ] && [ "${r:$(( (64 + 2) * 2 )):2}" = 01 ] && [ "${r:$(( (128 + 2) * 2 )):2}" = 01 ] ||
    { say "expected type 5 with both registrants holding it: $r"; return 1; }
  resv_write A2 21 && resv_write B2 22 || { say "a registrant could not write: $(cat "$WORK/resv.out")"; return 1; }
  resv_ok "B preempting A by key (A fenced from the cluster)" resv-acquire "$(resv_dev B2)" -n 1 \
    --crkey=0x${RESV_KEY[B]} --prkey=0x${RESV_KEY[A]} --rtype=5 --racqa=1 || return 1
  r=$(resv_report B2) || return 1; resv_summary "$r"
  [ "${r:8:2}" = 05 ] && [ "${r:10:2}" = 01 ] || { say "expected type 5 with B alone registered"; return 1; }
  resv_write A2 23 && { say "the preempted A still writes"; return 1; }
  grep -qiE "$RESV_CONFLICT" "$WORK/resv.out" || { say "A's write: $(cat "$WORK/resv.out")"; return 1; }
  resv_read A2 || { say "the preempted A cannot read: $(cat "$WORK/resv.out")"; return 1; }
  resv_ok "A registering again (the node rejoins)" resv-register "$(resv_dev A2)" -n 1 \
    --nrkey=0x${RESV_KEY[A]} --rrega=0 || return 1
  resv_write A2 24 || { say "A, registered again, cannot write: $(cat "$WORK/resv.out")"; return 1; }
  RESV_BEFORE=$(resv_report A2) || return 1; resv_summary "$RESV_BEFORE"
}
resv_failback() {
  local t0 r=""
  ask 60 start-gw 1 || return 1
  t0=$(now)
  until r=$(resv_report A1 2> /dev/null) && [ -n "$r" ]; do
    [ "$(since "$t0" | cut -d. -f1)" -lt 60 ] || { say "no report through gw1 within 60 s"; return 1; }
    sleep 0.5
  done
  say "report through gw1 $(since "$t0") s after its start"; resv_summary "$r"
  [ "$r" = "$RESV_BEFORE" ] || { say "differs from the one gw2 gave:"; say "gw2 $RESV_BEFORE"; say "gw1 $r"; return 1; }
  resv_write B1 31 || { say "B cannot write through gw1: $(cat "$WORK/resv.out")"; return 1; }
}
resv_cleanup() {
  local rc=0
  resv_nv resv-release "$(resv_dev B1)" -n 1 --crkey=0x${RESV_KEY[B]} --rrela=1 ||
    resv_nv resv-release "$(resv_dev B2)" -n 1 --crkey=0x${RESV_KEY[B]} --rrela=1 || say "Clear failed: $(cat "$WORK/resv.out")"
  disconnect_nqn "$RESV_NQN" || { delete_ctrls "$RESV_NQN"; rc=1; }
  ctl subsystem del --nqn "$RESV_NQN" --force || rc=1
  ask 60 rbd-rm "$RESV_IMAGE" || rc=1
  return $rc
}

tenant_resv() {
  if step resv.setup "subsystem, listeners on gw1/gw2, namespace 1 in ANA group 1" resv_setup &&
     step resv.connect "hosts A and B on gw1 and gw2: four controllers; ONCS" resv_connect; then
    step resv.register "register through the owner; ANA Inaccessible through gw2" resv_register &&
    step resv.conflict "A's Write Exclusive: B's Acquire and write conflict" resv_conflict &&
    step resv.failover "kill -9 gw1: gw2 reports the same state, B still conflicts" resv_failover &&
    step resv.wear "Write Exclusive - All Registrants as Windows clustering uses it" resv_wear
    # Runs whatever happened above: it starts gw1 again if the failover step killed it (the
    # part leaves the group as it found it).
    step resv.failback "gw1 back: group 1 fails back with the state gw2 stored" resv_failback
  fi
  step resv.cleanup "clear, disconnect, subsystem and image deleted" resv_cleanup
}
