# shellcheck shell=bash
# guest-lib.sh - what the in-guest scripts share (sourced, not run; after steps.sh, whose say,
# now, since, skip and RESULTS it uses). They set NQN (the subsystem under test) and, for the
# helpers that use them, DEV (the namespace's block device), WORK (scratch directory), LOGDIR,
# GWPID / GWLOG (a gateway run inside the guest) and ALL (every step name, for skip_from).
#
# Initiator
#   ns_dev_once [NSID]      the block device (multipath head or plain) of $NQN's namespace NSID
#                           (any namespace when NSID is empty); 1 when there is none
#   ns_dev [NSID] [TENTHS]  ns_dev_once, retried every 0.1 s up to TENTHS times (default 150)
#   connected_ctrls NQN     the controllers (nvmeX) connected to subsystem NQN, one a line
#   disconnect_nqn NQN      nvme disconnect, then wait up to 15 s until its controllers are gone
#   delete_ctrls NQN        delete every controller of NQN through sysfs (cleanup; no wait)
#   host_ctrl SUBNQN HOSTNQN PORT  the controller (nvmeX) connected with these
#   multipath_setup [NOTE]  load nvme-tcp; 0 when native NVMe multipath is on
#   discover_on_ports PORT P1,P2...  nvme discover (tcp, $ADDR:PORT, $HOSTNQN/$HOSTID, JSON
#                           kept in $LOGDIR/discover.json): 0 when $NQN is listed over tcp on
#                           every port of the list
#   fio_run LABEL ARGS...   fio on $DEV with crc32c verify; output in $WORK and $LOGDIR
#   fs_check                mkfs.ext4 on $DEV, a 16 MiB random file, remount: sha256 equal;
#                           sets FS_SHA
#   fs_reread               (after fs_check and a disconnect) connect, mount read-only, sets
#                           FS_GOT to the file's sha256; the caller compares with FS_SHA
# A target inside the guest
#   port_listening PORT     something listens on $ADDR:PORT (IPv4, from /proc/net/tcp)
#   run_gateway CONF LOG PORT...  starts $GW --config CONF (output to LOG), sets STARTED_PID;
#                           0 once every PORT listens (up to 15 s), 1 when it exited or did not
#   nullb NAME              a memory-backed 64 MiB null_blk device /dev/NAME (for nvmet)
#   guest_log_dir NAME      LOGDIR=$E2E_LOG_DIR/NAME (default ./target/vm-logs if writable,
#                           else /tmp/e2e-logs), created and emptied
#   gwlog_tail N            the last N lines of $GWLOG
#   sigterm_gateway         SIGTERM to $GWPID, SIGKILL after 10 s (then 1); GW_STATUS = its exit
#                           status; 1 when it was not running
#   kill_gateway            cleanup: SIGKILL $GWPID if it runs, keep $GWLOG in $LOGDIR
# Steps and summary
#   skip_from STEP REASON   every step of ALL from STEP on is "not run"
#   guest_summary TITLE [FN] the summary block: step results, FN's lines (extra figures), the
#                           total time, the gateway log's tail when a step failed ($GWLOG);
#                           its last line "N passed, N failed"

ns_dev_once() {
  local s n b
  for s in /sys/class/nvme-subsystem/nvme-subsys*; do
    [ "$(cat "$s/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
    for n in "$s"/nvme*n* "$s"/nvme*/nvme*n*; do
      b=${n##*/}
      case $b in *c*n*) continue ;; esac  # hidden per-path nodes
      [ -z "${1:-}" ] || [ "$(cat "/sys/block/$b/nsid" 2>/dev/null)" = "$1" ] || continue
      [ -b "/dev/$b" ] && { echo "/dev/$b"; return 0; }
    done
  done
  return 1
}
host_ctrl() { # subnqn hostnqn port: the controller connected with these
  local c
  for c in /sys/class/nvme/nvme*; do
    [ "$(cat $c/subsysnqn 2>/dev/null)" = "$1" ] && [ "$(cat $c/hostnqn 2>/dev/null)" = "$2" ] &&
      grep -q "trsvcid=$3\b" $c/address 2>/dev/null && { echo "${c##*/}"; return 0; }
  done
  return 1
}
ns_dev() {
  for _ in $(seq "${2:-150}"); do ns_dev_once "${1:-}" && return 0; sleep 0.1; done
  return 1
}
connected_ctrls() {
  local c
  for c in /sys/class/nvme/nvme*; do
    [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && echo "${c##*/}"
  done
}
ctrls_live() { # NQN SECONDS: every controller of NQN live within SECONDS
  local end=$(( $(date +%s) + $2 )) c all
  while [ "$(date +%s)" -lt "$end" ]; do
    all=1
    for c in $(connected_ctrls "$1"); do
      [ "$(cat "/sys/class/nvme/$c/state" 2>/dev/null)" = live ] || all=0
    done
    [ $all -eq 1 ] && return 0
    sleep 0.2
  done
  return 1
}
ctrls_report() { # NQN: its controllers' states, and the kernel's blocked tasks (sysrq w)
  local c
  for c in $(connected_ctrls "$1"); do
    say "  $c $(cat "/sys/class/nvme/$c/state" 2>/dev/null) $(cat "/sys/class/nvme/$c/address" 2>/dev/null)"
  done
  echo w > /proc/sysrq-trigger 2>/dev/null
  sleep 1
  dmesg | tail -n 60 | sed 's/^/    dmesg: /'
}
disconnect_nqn() {
  timeout -k 5 60 nvme disconnect -n "$1" 2>&1 | sed 's/^/    /'
  for _ in $(seq 150); do [ -z "$(connected_ctrls "$1")" ] && return 0; sleep 0.1; done
  say "controllers of $1 still present: $(connected_ctrls "$1" | tr '\n' ' ')"
  return 1
}
delete_ctrls() {
  local c
  for c in $(connected_ctrls "$1"); do echo 1 > "/sys/class/nvme/$c/delete_controller" 2>/dev/null; done
}
multipath_setup() {
  modprobe -a nvme-core nvme-tcp || return 1
  local mp; mp=$(cat /sys/module/nvme_core/parameters/multipath)
  say "nvme_core multipath=$mp${1:+, $1}"
  [ "$mp" = Y ]
}
discover_on_ports() {
  local out
  out=$(timeout -k 5 60 nvme discover -t tcp -a "$ADDR" -s "$1" --hostnqn="$HOSTNQN" --hostid="$HOSTID" -o json 2>&1) ||
    { say "nvme discover -t tcp -a $ADDR -s $1 failed: $out"; return 1; }
  echo "$out" > "$LOGDIR/discover.json"
  echo "$out" | python3 -c '
import json, sys
recs = json.load(sys.stdin)["records"]
nqn, ports = sys.argv[1], sys.argv[2].split(",")
for r in recs:
    print("    record: %s %s %s:%s %s" % (r.get("subtype"), r.get("trtype"), r.get("traddr"), r.get("trsvcid"), r.get("subnqn")))
seen = {r["trsvcid"].strip() for r in recs if r.get("subnqn", "").strip() == nqn and r.get("trtype", "").strip() == "tcp"}
missing = [p for p in ports if p not in seen]
if missing:
    print("    %s is not listed on port(s) %s" % (nqn, missing)); sys.exit(1)
print("    %s listed on ports %s" % (nqn, ", ".join(sorted(seen))))' "$NQN" "$2"
}

fio_run() {
  local label=$1; shift
  local out=$WORK/fio-$label.log
  # SIGPIPE ignored: see load_start in guest-load.sh.
  (cd /tmp && trap '' PIPE && timeout -k 10 300 fio --name="$label" --filename="$DEV" --direct=1 --ioengine=libaio \
     --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 --group_reporting "$@") > "$out" 2>&1
  local rc=$?
  cp "$out" "$LOGDIR/" 2>/dev/null
  grep -E 'IOPS|err=|verify|error|fio:' "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "fio failed (rc=$rc$([ $rc -eq 124 ] && echo ': timeout')); full output in $out"; tail -n 5 "$out" | sed 's/^/    | /'; return 1; }
  grep -qE 'err= *[1-9]' "$out" && { say "fio reported errors"; return 1; }
  return 0
}
FS_SHA="" FS_GOT=""
fs_check() {
  local m=/mnt/e2e blob=$WORK/blob want got
  mkdir -p $m
  head -c 16M /dev/urandom > "$blob" || return 1
  want=$(sha256sum < "$blob" | cut -d' ' -f1)
  timeout -k 5 120 mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "$DEV" || { say "mkfs.ext4 failed"; return 1; }
  timeout -k 5 60 mount "$DEV" $m || { say "mount failed"; return 1; }
  timeout -k 5 120 cp "$blob" $m/blob && timeout -k 5 120 sync || { say "write/sync failed"; umount $m; return 1; }
  timeout -k 5 60 umount $m || { say "umount failed"; return 1; }
  echo 3 > /proc/sys/vm/drop_caches
  timeout -k 5 60 mount "$DEV" $m || { say "second mount failed"; return 1; }
  got=$(timeout -k 5 120 sha256sum < $m/blob | cut -d' ' -f1)
  timeout -k 5 60 umount $m || { say "final umount failed"; return 1; }
  say "sha256 written=$want read-back=$got"
  [ "$want" = "$got" ] || { say "sha256 MISMATCH"; return 1; }
  FS_SHA=$want
}
fs_reread() {
  [ -n "$FS_SHA" ] || { say "step d did not complete: nothing to compare"; return 1; }
  connect || return 1
  local m=/mnt/e2e
  timeout -k 5 60 mount -o ro "$DEV" $m || { say "mount after reconnect failed"; return 1; }
  FS_GOT=$(timeout -k 5 120 sha256sum < $m/blob | cut -d' ' -f1)
  timeout -k 5 60 umount $m
  say "sha256 before disconnect=$FS_SHA after reconnect=$FS_GOT"
}

port_listening() { # port: something listens on $ADDR:port (hex in /proc/net/tcp)
  local hp; hp=$(printf ':%04X' "$1")
  awk -v hp="$hp" 'NR > 1 && $2 ~ hp"$" && $4 == "0A" {f = 1} END {exit !f}' /proc/net/tcp
}
run_gateway() { # config log port...: starts our binary, sets STARTED_PID; 0 once every port listens
  local conf=$1 log=$2 p waiting
  shift 2
  echo "----- gateway start at guest uptime $(now) -----" >> "$log"
  "$GW" --config "$conf" >> "$log" 2>&1 < /dev/null &
  STARTED_PID=$!
  say "$GW --config $conf (pid $STARTED_PID, log $log)"
  # The listeners come up one after another, so wait for each rather than the first.
  for _ in $(seq 150); do  # up to ~15 s
    waiting=""
    for p in "$@"; do port_listening "$p" || waiting="$waiting $p"; done
    [ -z "$waiting" ] && { say "listening on $ADDR port(s) $*"; return 0; }
    kill -0 $STARTED_PID 2>/dev/null || { say "gateway exited during startup: $(wait $STARTED_PID; echo "exit status $?")"; STARTED_PID=""; return 1; }
    sleep 0.1
  done
  say "nothing listening on $ADDR port(s)$waiting after 15 s"
  return 1
}
nullb() { # name: a memory-backed 64 MiB null_blk device /dev/NAME
  local nb=/sys/kernel/config/nullb/$1
  [ -d $nb ] || { mkdir $nb && echo 64 > $nb/size && echo 512 > $nb/blocksize && echo 1 > $nb/memory_backed && echo 1 > $nb/power; } || return 1
  for _ in $(seq 50); do [ -b /dev/$1 ] && return 0; sleep 0.1; done
  say "null_blk device /dev/$1 did not appear"; return 1
}
guest_log_dir() {
  if [ -n "${E2E_LOG_DIR:-}" ]; then LOGDIR=$E2E_LOG_DIR
  elif [ -d target/vm-logs ] && [ -w target/vm-logs ] && touch target/vm-logs/.w 2>/dev/null; then LOGDIR=$PWD/target/vm-logs
  else LOGDIR=/tmp/e2e-logs; fi
  LOGDIR=$LOGDIR/$1
  mkdir -p "$LOGDIR" 2>/dev/null && rm -f "$LOGDIR"/* 2>/dev/null
}
gwlog_tail() {
  [ -s "$GWLOG" ] || return 0
  echo "    --- gateway log (last ${1} lines of $GWLOG) ---"
  tail -n "$1" "$GWLOG" | sed 's/\x1b\[[0-9;]*m//g; s/^/    | /'
}
GW_STATUS=""
sigterm_gateway() {
  GW_STATUS=""
  [ -n "$GWPID" ] || { say "gateway not running"; return 1; }
  if ! kill -0 "$GWPID" 2>/dev/null; then
    wait "$GWPID"; say "gateway had already exited (status $?) before SIGTERM"; GWPID=""; return 1
  fi
  local t0; t0=$(now)
  kill -TERM "$GWPID"
  for _ in $(seq 100); do kill -0 "$GWPID" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$GWPID" 2>/dev/null; then
    say "gateway still running 10 s after SIGTERM: sending SIGKILL"
    kill -KILL "$GWPID"; wait "$GWPID" 2>/dev/null; GWPID=""; return 1
  fi
  wait "$GWPID"; GW_STATUS=$?
  GWPID=""
  say "gateway exited with status $GW_STATUS $(since "$t0")s after SIGTERM"
}
kill_gateway() {
  if [ -n "$GWPID" ] && kill -0 "$GWPID" 2>/dev/null; then kill -KILL "$GWPID" 2>/dev/null; fi
  [ -s "$GWLOG" ] && cp "$GWLOG" "$LOGDIR/" 2>/dev/null
}

skip_from() {
  local on=0 s
  for s in "${ALL[@]}"; do [ "$s" = "$1" ] && on=1; [ $on = 1 ] && skip "$s" "$2"; done
}
guest_summary() {
  echo
  echo "================ $1 ================"
  printf '%s\n' "${RESULTS[@]}"
  [ -n "${2:-}" ] && "$2"
  echo "total $(since "$T_ALL")s; logs: $LOGDIR"
  if [ "$FAIL" -gt 0 ] && [ -s "${GWLOG:-}" ]; then
    echo "---- gateway log tail ($LOGDIR/gateway.log) ----"
    tail -n 40 "$GWLOG" | sed 's/\x1b\[[0-9;]*m//g'
  fi
  echo "$PASS passed, $FAIL failed"
}
