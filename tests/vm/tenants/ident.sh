# shellcheck shell=bash
# tests/vm/tenants/ident.sh - part "ident" of the e2e-tenants stage (sourced by
# tests/vm/e2e-tenants-guest.sh, see its header): a namespace's identity is never given to
# another image, with the real Linux host connected while its NSID changes hands.
#
# Subsystem $IDENT_NQN (any host), images ident-a and ident-b (16 MiB each). The host stays
# connected to both gateways throughout. Steps:
#   ident.setup    rbd-create both images; subsystem, listeners on gw1 and gw2, ident-a as NSID 1
#                  (ANA group 1)
#   ident.connect  both paths; the namespace's UUID and NGUID in sysfs are the ones nvmeofctl
#                  lists; 4 KiB of 'A' written at offset 0
#   ident.hold     a process opens the device (O_DIRECT) and keeps it open, as an application
#                  or a stale mapping would
#   ident.swap     namespace del NSID 1, then ident-b added as NSID 1, while connected: nvmeofctl
#                  lists another UUID; after the host's rescan (the gateways' Namespace
#                  Attribute Changed notice, and nvme ns-rescan) NSID 1's block device has the
#                  new UUID, never the old one
#   ident.stale    the process that held the old device writes 4 KiB of 'X' through it: the
#                  write must not reach ident-b (it fails; what Linux answered is printed).
#                  Checked on the images (rbd export): ident-b is zeros there, ident-a still 'A'
# What Linux 6.1 did (first run): the rescan after the deletion removed nvme0n1; ident-b came
# as nvme0n2 with its own UUID; the held descriptor's write failed with ENOSPC (the removed
# disk's capacity is 0). Before identities were stored, ident-b came back with ident-a's
# UUID (ident.swap fails there).
#   ident.cleanup  disconnect, namespace and subsystem deleted, images removed
IDENT_NQN=nqn.2016-06.io.ceph-nvmeof-rs:tenants-ident
IDENT_OLD_UUID="" IDENT_NEW_UUID="" IDENT_DEV="" IDENT_HOLDER=""

ident_listed_uuid() { # the UUID nvmeofctl lists for NSID 1 of $IDENT_NQN
  ctl -o json namespace list -n "$IDENT_NQN" | python3 -c '
import json, sys
print(next(n["uuid"] for n in json.load(sys.stdin)["namespaces"] if n["nsid"] == 1))'
}

ident_setup() {
  ask 60 rbd-create ident-a 16 || return 1
  ask 60 rbd-create ident-b 16 || return 1
  ctl subsystem add --nqn "$IDENT_NQN" --allow-any-host || return 1
  ctl listener add -n "$IDENT_NQN" -g gw1 -a 127.0.0.1 -p "${PORTS[0]}" || return 1
  ctl listener add -n "$IDENT_NQN" -g gw2 -a 127.0.0.1 -p "${PORTS[1]}" || return 1
  ctl namespace add -n "$IDENT_NQN" --image ident-a --nsid 1 --ana-group 1 || return 1
}

ident_connect() {
  local p b
  for p in "${PORTS[@]}"; do
    timeout -k 5 30 nvme connect -t tcp -a "$ADDR" -s "$p" -n "$IDENT_NQN" -l 120 2>&1 | sed 's/^/    /'
  done
  NQN=$IDENT_NQN
  IDENT_DEV=$(ns_dev 1) || { say "no block device for NSID 1"; return 1; }
  ctrls_live "$IDENT_NQN" 20 || { ctrls_report "$IDENT_NQN"; return 1; }
  b=${IDENT_DEV#/dev/}
  IDENT_OLD_UUID=$(ident_listed_uuid) || return 1
  say "$IDENT_DEV: uuid $(cat "/sys/block/$b/uuid") nguid $(cat "/sys/block/$b/nguid"); listed $IDENT_OLD_UUID"
  [ "$(cat "/sys/block/$b/uuid")" = "$IDENT_OLD_UUID" ] || { say "the host sees another UUID than listed"; return 1; }
  [ "$(cat "/sys/block/$b/nguid" | tr -d -)" = "$(tr -d - <<< "$IDENT_OLD_UUID")" ] ||
    { say "the NGUID is not the UUID's bytes"; return 1; }
  head -c 4096 /dev/zero | tr '\0' 'A' > "$SH/ident-a.blk"
  dd if="$SH/ident-a.blk" of="$IDENT_DEV" bs=4096 count=1 oflag=direct conv=notrunc status=none
}

# Opens $IDENT_DEV and keeps it; on $WORK/ident.go writes 4 KiB of 'X' at offset 0 through it
# and puts the outcome in $WORK/ident.result ("written" or "refused: <errno name>").
ident_hold() {
  rm -f "$WORK/ident.go" "$WORK/ident.result" "$WORK/ident.ready"
  python3 - "$IDENT_DEV" "$WORK" <<'EOF' &
import errno, mmap, os, sys, time
dev, work = sys.argv[1], sys.argv[2]
fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
open(os.path.join(work, "ident.ready"), "w").close()
while not os.path.exists(os.path.join(work, "ident.go")):
    time.sleep(0.1)
buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
buf.write(b"X" * 4096)
try:
    os.pwrite(fd, buf, 0)
    os.fsync(fd)
    outcome = "written"
except OSError as e:
    outcome = "refused: " + errno.errorcode.get(e.errno, str(e.errno))
with open(os.path.join(work, "ident.result"), "w") as f:
    f.write(outcome + "\n")
EOF
  IDENT_HOLDER=$!
  for _ in $(seq 100); do [ -e "$WORK/ident.ready" ] && return 0; sleep 0.1; done
  say "the holder did not open $IDENT_DEV"; return 1
}

ident_new_dev() { # the block device of NSID 1 whose UUID is $IDENT_NEW_UUID
  local d
  d=$(ns_dev_once 1) || return 1
  [ "$(cat "/sys/block/${d#/dev/}/uuid" 2>/dev/null)" = "$IDENT_NEW_UUID" ] && echo "$d"
}

ident_swap() {
  local c d="" end
  ctl namespace del -n "$IDENT_NQN" --nsid 1 || return 1
  ctl namespace add -n "$IDENT_NQN" --image ident-b --nsid 1 --ana-group 1 || return 1
  IDENT_NEW_UUID=$(ident_listed_uuid) || return 1
  say "NSID 1 is now ident-b with UUID $IDENT_NEW_UUID (was $IDENT_OLD_UUID)"
  [ "$IDENT_NEW_UUID" != "$IDENT_OLD_UUID" ] || { say "the new image got the old UUID"; return 1; }
  end=$(( $(date +%s) + 30 ))
  while [ "$(date +%s)" -lt "$end" ]; do
    d=$(ident_new_dev) && break
    for c in $(connected_ctrls "$IDENT_NQN"); do nvme ns-rescan "/dev/$c" >/dev/null 2>&1; done
    sleep 0.5
  done
  [ -n "$d" ] || { say "no block device with the new UUID; NSID 1: $(ns_dev_once 1) uuid $(cat "/sys/block/$(ns_dev_once 1 | sed 's|/dev/||')/uuid" 2>/dev/null)"; return 1; }
  say "the host presents NSID 1 as $d with UUID $IDENT_NEW_UUID (the old one was $IDENT_DEV)"
  dmesg | grep -iE "nvme.*(identifiers changed|ns.*removed|IDs don't match)" | tail -n 3 | sed 's/^/    dmesg: /'
  ctrls_live "$IDENT_NQN" 20 || { ctrls_report "$IDENT_NQN"; return 1; }
}

ident_stale() {
  touch "$WORK/ident.go"
  for _ in $(seq 300); do [ -s "$WORK/ident.result" ] && break; sleep 0.1; done
  wait "$IDENT_HOLDER" 2>/dev/null
  IDENT_HOLDER=""
  [ -s "$WORK/ident.result" ] || { say "the holder's write never ended"; return 1; }
  say "a write through the old device: $(cat "$WORK/ident.result")"
  ask 60 check ident-b zero 0 4096 || { say "the old device's write reached ident-b"; return 1; }
  ask 60 check ident-a cmp 0 ident-a.blk || return 1
}

ident_cleanup() {
  [ -z "$IDENT_HOLDER" ] || { touch "$WORK/ident.go"; wait "$IDENT_HOLDER" 2>/dev/null; }
  disconnect_nqn "$IDENT_NQN"
  ctl subsystem del --nqn "$IDENT_NQN" --force || return 1
  ask 60 rbd-rm ident-a || return 1
  ask 60 rbd-rm ident-b
}

tenant_ident() {
  if step ident.setup "both images; subsystem, listeners on gw1/gw2, ident-a as NSID 1" ident_setup &&
     step ident.connect "both paths; sysfs UUID/NGUID as listed; 'A' written" ident_connect &&
     step ident.hold "a process keeps the device open" ident_hold; then
    step ident.swap "NSID 1 deleted, ident-b added as NSID 1 while connected: a new UUID on the host" ident_swap &&
    step ident.stale "a write through the old device does not reach ident-b" ident_stale
  fi
  step ident.cleanup "disconnect, namespace and subsystem deleted, images removed" ident_cleanup
}
