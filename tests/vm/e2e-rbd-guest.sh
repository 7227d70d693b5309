#!/bin/bash
# e2e-rbd-guest.sh - the in-guest half of tests/vm/e2e-rbd.sh (run by it through
# tests/vm/run-in-vm.sh; not meant to be run by hand):
#
#   e2e-rbd-guest.sh SHARED_DIR PORT
#
# The gateway runs on the host and serves rbd/e2e-a as nsid 1; nsid 2 (rbd/e2e-missing) does
# not exist when the gateway starts. The guest connects with the real Linux initiator to
# 10.0.2.2:PORT (the host's 127.0.0.1) and asks the host, through request files in
# SHARED_DIR/sig (see e2e-rbd.sh), to export, resize, create images and to stop the OSD.
# Steps (each timed, PASS/FAIL):
#   connect    nvme connect; nsid 1 is 256 MiB with 512 B blocks, nsid 2 is absent
#   data       16 MiB of random data dd'd at 8 MiB, read back here, and equal byte for byte in
#              the host's `rbd export`
#   resize     `rbd resize` to 384 MiB on the host; /sys/block/nvmeXnY/size follows without a
#              reconnect (same controller, still live); the new tail is readable
#   discard    blkdiscard (DSM deallocate) of 1 MiB inside 2 MiB of random data: zeros here
#              and in `rbd export`, the other half intact
#   zeroes     the same with `blkdiscard -z` and with `nvme write-zeroes`
#   osd-outage fio --verify=crc32c 4K randwrite while the host kills osd.0 for 10 s and
#              restarts it: fio completes without error, its max latency shows the pause
#   missing    the host creates rbd/e2e-missing: the gateway's retry opens it and nsid 2
#              appears here (Namespace Attribute Changed), 64 MiB, writable
#   disconnect nvme disconnect
# Last line: "N passed, N failed".
set -u
export LC_ALL=C

SH=${1:?usage: e2e-rbd-guest.sh SHARED_DIR PORT}
PORT=${2:?usage: e2e-rbd-guest.sh SHARED_DIR PORT}
SIG=$SH/sig
ADDR=10.0.2.2
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-rbd
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2e0bd00-0000-4000-8000-000000000001
HOSTID=e2e0bd00-0000-4000-8000-000000000001
IMG=e2e-a
MISSING=e2e-missing
MIB=1048576
NS_BYTES=$((256 * MIB))
RESIZED=384M
RESIZED_BYTES=$((384 * MIB))
MISSING_BYTES=$((64 * MIB))
OUTAGE_S=10
WORK=/tmp/e2e-rbd
mkdir -p "$WORK"
LOGDIR=$SH/guest
mkdir -p "$LOGDIR"
# --ctrl-loss-tmo: a broken target fails a step within a minute instead of hanging for 10 min
COPTS=(-t tcp -a "$ADDR" -s "$PORT" --ctrl-loss-tmo=60 --reconnect-delay=1)

. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"  # ask
. "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh"  # ns_dev, connected_ctrls...
on_step_failure() { dmesg | grep -iE 'nvme' | tail -n 8 | sed 's/^/    dmesg: /'; }


# ------------------------------------------------------------- initiator --
ctrl() { # the controller (nvmeX) connected to $NQN
  local c; c=$(connected_ctrls "$NQN" | head -n 1)
  [ -n "$c" ] && echo "$c"
}
bytes() { echo $(( $(cat "/sys/block/${1#/dev/}/size") * 512 )); }
DEV="" CTRL="" CNTLID=""
connect() {
  local out rc
  out=$(timeout -k 5 90 nvme connect "${COPTS[@]}" -n "$NQN" --hostnqn="$HOSTNQN" --hostid="$HOSTID" 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme connect -t tcp -a $ADDR -s $PORT failed (rc=$rc)"; return 1; }
  DEV=$(ns_dev 1) || { say "connected, but no block device for nsid 1 within 15 s"; DEV=""; return 1; }
  CTRL=$(ctrl); CNTLID=$(cat "/sys/class/nvme/$CTRL/cntlid")
  local sz lbs
  sz=$(bytes "$DEV"); lbs=$(cat "/sys/block/${DEV#/dev/}/queue/logical_block_size")
  say "nsid 1: $DEV, $sz bytes, logical block $lbs; controller $CTRL cntlid $CNTLID, model '$(xargs < "/sys/class/nvme/$CTRL/model")'"
  [ "$sz" -eq $NS_BYTES ] || { say "size $sz != $NS_BYTES (rbd/$IMG)"; return 1; }
  [ "$lbs" -eq 512 ] || { say "logical block size $lbs != 512"; return 1; }
}
same_controller() { # the controller of connect() is still there, live, same cntlid
  local st c
  c=$(ctrl) || { say "no controller for $NQN any more"; return 1; }
  st=$(cat "/sys/class/nvme/$c/state")
  [ "$c" = "$CTRL" ] && [ "$(cat "/sys/class/nvme/$c/cntlid")" = "$CNTLID" ] ||
    { say "controller changed: $CTRL/$CNTLID -> $c/$(cat "/sys/class/nvme/$c/cntlid")"; return 1; }
  [ "$st" = live ] || { say "controller $c state $st"; return 1; }
}
dmesg_mark() { dmesg | wc -l; }
dmesg_since() { dmesg | tail -n +$(($1 + 1)) | grep -iE 'nvme'; }
resets_since() { dmesg_since "$1" | grep -ciE 'reset|reconnect|timeout|error|abort'; }

# --------------------------------------------------------------- steps --
missing_absent() {
  local ids
  ids=$(timeout -k 5 30 nvme list-ns "/dev/$CTRL" 2>&1)
  say "nvme list-ns /dev/$CTRL: $(echo "$ids" | tr '\n' ' ')"
  echo "$ids" | grep -qiE '0x2\b|:2$' && { say "nsid 2 is listed although rbd/$MISSING does not exist"; return 1; }
  ns_dev_once 2 >/dev/null && { say "a block device for nsid 2 exists"; return 1; }
  return 0
}
connect_step() { connect && missing_absent; }

data_check() { # random data through the gateway, read back here and by rbd export
  local f=$SH/data.bin
  head -c $((16 * MIB)) /dev/urandom > "$WORK/data.bin" && cp "$WORK/data.bin" "$f" || return 1
  timeout -k 5 120 dd if="$WORK/data.bin" of="$DEV" bs=1M seek=8 oflag=direct conv=fsync status=none ||
    { say "dd write failed"; return 1; }
  timeout -k 5 120 dd if="$DEV" bs=1M skip=8 count=16 iflag=direct status=none | cmp - "$WORK/data.bin" ||
    { say "read back through the gateway differs"; return 1; }
  say "16 MiB written at offset 8 MiB and read back identical in the guest"
  ask 180 check "$IMG" cmp $((8 * MIB)) data.bin
}

resize_check() { # rbd resize on the host reaches the connected host, no reconnect
  local b=${DEV#/dev/} before after m t0
  before=$(bytes "$DEV"); m=$(dmesg_mark)
  ask 90 resize "$IMG" "$RESIZED" || return 1
  t0=$(now)
  for _ in $(seq 300); do  # 30 s
    after=$(bytes "$DEV")
    [ "$after" != "$before" ] && break
    sleep 0.1
  done
  say "/sys/block/$b/size: $((before / 512)) -> $((after / 512)) sectors, $(since "$t0")s after the host's rbd resize returned"
  dmesg_since "$m" | tail -n 3 | sed 's/^/    dmesg: /'
  [ "$after" -eq $RESIZED_BYTES ] || { say "size $after != $RESIZED_BYTES"; return 1; }
  same_controller || return 1
  local nsze
  nsze=$(timeout -k 5 30 nvme id-ns "$DEV" 2>/dev/null | awk '/^nsze/ {print $3}')
  say "id-ns nsze $nsze"
  [ "$((nsze))" -eq $((RESIZED_BYTES / 512)) ] || { say "nsze != $((RESIZED_BYTES / 512))"; return 1; }
  timeout -k 5 60 dd if="$DEV" of=/dev/null bs=1M skip=$((RESIZED_BYTES / MIB - 1)) count=1 iflag=direct status=none ||
    { say "reading the last MiB of the grown namespace failed"; return 1; }
  say "the last MiB of the grown namespace is readable"
}

# zero_region NAME OFFSET_MIB CMD...: 2 MiB random at OFFSET, CMD zeroes the first MiB;
# checks here: first MiB zeros, second MiB intact; saves the second MiB as NAME.bin
zero_region() {
  local name=$1 off=$2; shift 2
  head -c $((2 * MIB)) /dev/urandom > "$WORK/$name.bin" || return 1
  tail -c $MIB "$WORK/$name.bin" > "$SH/$name.bin" || return 1
  timeout -k 5 60 dd if="$WORK/$name.bin" of="$DEV" bs=1M seek="$off" oflag=direct conv=fsync status=none || { say "dd write failed"; return 1; }
  timeout -k 5 60 "$@" > "$WORK/$name.out" 2>&1 || { say "$* failed: $(cat "$WORK/$name.out")"; return 1; }
  say "$*: ok"
  timeout -k 5 60 dd if="$DEV" bs=1M skip="$off" count=1 iflag=direct status=none | cmp -n $MIB - /dev/zero ||
    { say "$name: the zeroed MiB at ${off} MiB does not read zeros"; return 1; }
  timeout -k 5 60 dd if="$DEV" bs=1M skip=$((off + 1)) count=1 iflag=direct status=none | cmp - "$SH/$name.bin" ||
    { say "$name: the MiB after the zeroed one changed"; return 1; }
  say "$name: zeros at [$off, $((off + 1))) MiB, data intact at [$((off + 1)), $((off + 2))) MiB (read in the guest)"
}
discard_check() {
  local q=/sys/block/${DEV#/dev/}/queue
  say "discard_max_bytes $(cat "$q/discard_max_bytes"), discard_granularity $(cat "$q/discard_granularity")"
  [ "$(cat "$q/discard_max_bytes")" -gt 0 ] || { say "the kernel did not enable discard on $DEV"; return 1; }
  zero_region dsm 64 blkdiscard -o $((64 * MIB)) -l $MIB "$DEV" || return 1
  ask 180 check "$IMG" zero $((64 * MIB)) $MIB cmp $((65 * MIB)) dsm.bin
}
zeroes_check() {
  local q=/sys/block/${DEV#/dev/}/queue
  say "write_zeroes_max_bytes $(cat "$q/write_zeroes_max_bytes")"
  zero_region wz-blk 80 blkdiscard -z -o $((80 * MIB)) -l $MIB "$DEV" || return 1
  zero_region wz-nvme 96 nvme write-zeroes "$DEV" --start-block=$((96 * MIB / 512)) --block-count=$((MIB / 512 - 1)) || return 1
  ask 180 check "$IMG" zero $((80 * MIB)) $MIB cmp $((81 * MIB)) wz-blk.bin zero $((96 * MIB)) $MIB cmp $((97 * MIB)) wz-nvme.bin
}

outage_check() { # fio verify while the OSD is down for $OUTAGE_S s
  local out=$WORK/fio-outage.json m rc pid
  m=$(dmesg_mark)
  (cd /tmp && exec timeout -k 10 300 fio --name=outage --filename="$DEV" --direct=1 --ioengine=libaio \
     --rw=randwrite --bs=4k --offset=128M --size=16M --iodepth=4 --rate_iops=300 \
     --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 \
     --output-format=json --output="$out") > "$WORK/fio-outage.stderr" 2>&1 &
  pid=$!
  sleep 3
  kill -0 "$pid" 2>/dev/null || { wait "$pid"; say "fio ended before the outage (rc $?): $(cat "$WORK/fio-outage.stderr")"; return 1; }
  say "fio running (4K randwrite, QD4, 300 IOPS, 16 MiB, crc32c verify); asking the host to kill osd.0 for ${OUTAGE_S}s"
  ask 120 osd-outage $OUTAGE_S || { wait "$pid"; return 1; }
  wait "$pid"; rc=$?
  cp "$out" "$LOGDIR/" 2>/dev/null
  local fio_error fio_ios clat_max_ms
  read -r fio_error fio_ios clat_max_ms < <(python3 - "$out" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    j = d["jobs"][0]
    print(j["error"], j["write"]["total_ios"], "%.0f" % (j["write"]["clat_ns"]["max"] / 1e6))
except Exception as e:
    print("parse-error 0 0")
PY
)
  say "fio rc=$rc error=$fio_error write ios=$fio_ios max write latency ${clat_max_ms} ms"
  local r; r=$(resets_since "$m")
  dmesg_since "$m" | tail -n 6 | sed 's/^/    dmesg: /'
  [ $rc -eq 0 ] || { say "fio failed: $(tail -n 5 "$WORK/fio-outage.stderr")"; return 1; }
  [ "$fio_error" = 0 ] || { say "fio reported error $fio_error"; return 1; }
  [ "${clat_max_ms:-0}" -ge $(( (OUTAGE_S - 2) * 1000 )) ] ||
    { say "max latency ${clat_max_ms} ms < $(( (OUTAGE_S - 2) * 1000 )) ms: the writes did not wait for the OSD"; return 1; }
  [ "$r" -eq 0 ] || { say "the kernel logged $r reset/timeout/error lines: the pause was not transparent"; return 1; }
  same_controller
}

missing_appears() { # the host creates the image; the gateway's retry serves it as nsid 2
  local d t0 sz
  ask 90 create "$MISSING" 64M || return 1
  t0=$(now)
  d=$(ns_dev 2 600) || { say "nsid 2 did not appear within 60 s of rbd create"; return 1; }
  sz=$(bytes "$d")
  say "nsid 2 appeared as $d after $(since "$t0")s ($sz bytes)"
  [ "$sz" -eq $MISSING_BYTES ] || { say "size $sz != $MISSING_BYTES"; return 1; }
  head -c $MIB /dev/urandom > "$WORK/m.bin"
  timeout -k 5 60 dd if="$WORK/m.bin" of="$d" bs=1M oflag=direct conv=fsync status=none &&
    timeout -k 5 60 dd if="$d" bs=1M count=1 iflag=direct status=none | cmp - "$WORK/m.bin" ||
    { say "write/read back on nsid 2 failed"; return 1; }
  say "1 MiB written and read back on nsid 2"
  same_controller
}

cleanup() {
  delete_ctrls "$NQN"
  dmesg > "$LOGDIR/dmesg.log" 2>/dev/null
}
trap cleanup EXIT

# ------------------------------------------------------------------ main --
echo "e2e-rbd-guest: guest $(uname -r), $(nproc) vCPU, nvme-cli $(nvme version 2>/dev/null | head -1 | awk '{print $3}'), gateway at $ADDR:$PORT"
step setup "load nvme-tcp" modprobe -a nvme-core nvme-tcp
if step connect "nvme connect -t tcp -a $ADDR -s $PORT; nsid 1 = rbd/$IMG 256 MiB, nsid 2 (missing image) absent" connect_step; then
  step data "16 MiB random data: read back in the guest and equal in rbd export" data_check
  step resize "rbd resize to $RESIZED on the host: /sys/block size follows, no reconnect" resize_check
  step discard "blkdiscard: zeros in the guest and in rbd export, neighbour intact" discard_check
  step write-zeroes "blkdiscard -z and nvme write-zeroes: zeros in the guest and in rbd export" zeroes_check
  step osd-outage "osd.0 killed for ${OUTAGE_S}s during fio --verify=crc32c: a pause, no error" outage_check
  step missing-image "rbd create of the missing image: nsid 2 appears, 64 MiB, writable" missing_appears
  step disconnect "nvme disconnect" disconnect_nqn "$NQN"
else
  for s in data resize discard write-zeroes osd-outage missing-image disconnect; do skip $s "connect failed"; done
fi
cleanup; trap - EXIT

guest_summary "e2e-rbd guest summary (guest $(uname -r), TCG)"
[ $FAIL -eq 0 ]
