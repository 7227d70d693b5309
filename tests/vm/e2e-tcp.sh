#!/bin/bash
# e2e-tcp.sh - end-to-end test of OUR NVMe/TCP gateway against the real Linux
# initiator. Runs INSIDE the test VM:
#
#   tests/vm/run-in-vm.sh -t 900 -w target/vm-logs tests/vm/e2e-tcp.sh target/release/nvmeof-gateway
#
# usage: e2e-tcp.sh [--kernel-target] <path-to-nvmeof-gateway>
#   --kernel-target  configure the kernel's nvmet (configfs, memory-backed
#                    null_blk) with the same NQNs/port instead of starting our
#                    binary; proves the script + initiator (no binary needed).
#
# Steps (each timed, PASS/FAIL): start gateway on 127.0.0.1:4420, (a) discover,
# (b) connect + namespace size, (c) fio crc32c verify (4K randwrite, 128K seq
# write), (d) mkfs.ext4 + 16 MiB sha256 round trip across a remount,
# (e) disconnect, SIGTERM (exit 0), restart, reconnect, read,
# (f) unknown host NQN refused, (g) unknown subsystem NQN refused (gateway
# alive after each), (h) final SIGTERM. Extra steps x1-x5: admin commands
# (id-ctrl/id-ns fields, logs, features), idling past KATO, data intact across
# a reconnect to the same process, header+data digests, nvme connect-all (SQ flow
# control disabled as the discovery log offers). Steps v6.*
# (e2e-tcp-ipv6.sh): a target on [::], discovered and connected over IPv6.
# Last line: "N passed, N failed". Exit 0 only if nothing failed.
#
# Env: E2E_LOG_DIR (default: ./target/vm-logs if writable, else /tmp/e2e-logs),
#      E2E_FIO_SIZE (default 32M), E2E_PORT (default 4420), RUST_LOG (default info),
#      E2E_PORT6, E2E_ADDR6 (see e2e-tcp-ipv6.sh).
set -u
export LC_ALL=C

MODE=gateway
if [ "${1:-}" = --kernel-target ]; then MODE=kernel; shift; fi
GW=${1:-}
if [ "$MODE" = gateway ]; then
  if [ -z "$GW" ]; then echo "usage: e2e-tcp.sh [--kernel-target] <nvmeof-gateway binary>"; echo "0 passed, 1 failed"; exit 2; fi
  case $GW in /*) ;; *) GW=$PWD/$GW ;; esac
  if [ ! -x "$GW" ]; then echo "FAIL: gateway binary not found or not executable: $GW"; echo "0 passed, 1 failed"; exit 2; fi
fi

ADDR=127.0.0.1
PORT=${E2E_PORT:-4420}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
HOSTID=11111111-2222-3333-4444-555555555555
BADHOSTNQN=nqn.2014-08.org.nvmexpress:uuid:99999999-8888-7777-6666-555555555555
BADHOSTID=99999999-8888-7777-6666-555555555555
UNKNOWN_NQN=nqn.2016-06.io.ceph-nvmeof-rs:no-such-subsystem
NS_BYTES=$((256 * 1024 * 1024))
NS_BS=512
FIO_SIZE=${E2E_FIO_SIZE:-32M}
export RUST_LOG=${RUST_LOG:-info}
export NO_COLOR=1  # plain gateway logs (tracing-subscriber honours NO_COLOR)

WORK=/tmp/e2e
mkdir -p $WORK
CONF=$WORK/gateway.toml
GWLOG=$WORK/gateway.log
# connect options: fail fast instead of retrying for 10 min if the target breaks
COPTS=(-t tcp -a "$ADDR" -s "$PORT" --ctrl-loss-tmo=5 --reconnect-delay=1)

GWPID=""
. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh"
. "$(dirname "${BASH_SOURCE[0]}")/e2e-tcp-ipv6.sh"
guest_log_dir e2e-tcp

on_step_failure() {
  gwlog_tail 15
  dmesg | grep -iE 'nvme|nvmet' | tail -n 8 | sed 's/^/    dmesg: /'
}

# ---------------------------------------------------------------- target --
GW_EXTRA=""  # lines for a [gateway] section (x6.data-budget)
write_config() {
  cat > "$CONF" <<EOF
$GW_EXTRA
[[listener]]
transport = "tcp"
address = "$ADDR"
port = $PORT

[[subsystem]]
nqn = "$NQN"
allow_any_host = false
hosts = ["$HOSTNQN"]

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "256MiB"
block_size = $NS_BS
EOF
  cp "$CONF" "$LOGDIR/" 2>/dev/null
}
port_listening() { # is something listening on $ADDR:$PORT (hex in /proc/net/tcp)?
  local hp; hp=$(printf ':%04X' "$PORT")
  awk -v hp="$hp" 'NR > 1 && $2 ~ hp"$" && $4 == "0A" {f = 1} END {exit !f}' /proc/net/tcp
}
gw_alive() { [ "$MODE" = kernel ] && return 0; [ -n "$GWPID" ] && kill -0 "$GWPID" 2>/dev/null; }

CFG=/sys/kernel/config/nvmet
kernel_start() { # nvmet with the same NQNs, host ACL and geometry as our config
  local nb=/sys/kernel/config/nullb/e2e s=$CFG/subsystems/$NQN p=$CFG/ports/1
  if [ ! -d $nb ]; then
    mkdir $nb && echo $((NS_BYTES / 1024 / 1024)) > $nb/size && echo $NS_BS > $nb/blocksize &&
      echo 1 > $nb/memory_backed && echo 1 > $nb/power || return 1
  fi
  local dev=""
  for _ in $(seq 50); do [ -b /dev/e2e ] && { dev=/dev/e2e; break; }; sleep 0.1; done
  [ -n "$dev" ] || { say "null_blk device did not appear"; return 1; }
  if [ ! -d "$s" ]; then
    mkdir "$CFG/hosts/$HOSTNQN" && mkdir "$s" && echo 0 > "$s/attr_allow_any_host" &&
      ln -s "$CFG/hosts/$HOSTNQN" "$s/allowed_hosts/" &&
      mkdir "$s/namespaces/1" && echo -n $dev > "$s/namespaces/1/device_path" &&
      echo 1 > "$s/namespaces/1/enable" || return 1
  fi
  mkdir $p && echo tcp > $p/addr_trtype && echo ipv4 > $p/addr_adrfam &&
    echo $ADDR > $p/addr_traddr && echo "$PORT" > $p/addr_trsvcid &&
    ln -s "$s" "$p/subsystems/$NQN"
}
kernel_stop() {
  local p=$CFG/ports/1
  [ -d $p ] || return 0
  rm -f "$p/subsystems/$NQN" && rmdir $p
}

start_gateway() { # [label]
  if [ "$MODE" = kernel ]; then
    say "kernel nvmet target (--kernel-target), not our binary"
    kernel_start || return 1
  else
    write_config
    say "$GW --config $CONF  (RUST_LOG=$RUST_LOG, log $GWLOG)"
    echo "----- gateway start ${1:-} at guest uptime $(now) -----" >> "$GWLOG"
    "$GW" --config "$CONF" >> "$GWLOG" 2>&1 < /dev/null &
    GWPID=$!
    say "gateway pid $GWPID"
  fi
  for _ in $(seq 150); do  # up to ~15 s
    port_listening && { say "listening on $ADDR:$PORT"; return 0; }
    gw_alive || { say "gateway exited during startup: $(wait "$GWPID"; echo "exit status $?")"; GWPID=""; return 1; }
    sleep 0.1
  done
  say "nothing listening on $ADDR:$PORT after 15 s"
  return 1
}
stop_gateway() { # SIGTERM; must exit 0 within 10 s
  if [ "$MODE" = kernel ]; then kernel_stop; return; fi
  sigterm_gateway || return 1
  port_listening && { say "port $PORT still listening after exit"; return 1; }
  [ "$GW_STATUS" -eq 0 ]
}

# ------------------------------------------------------------- initiator --
discover() {
  local out rc
  out=$(timeout -k 5 60 nvme discover -t tcp -a $ADDR -s "$PORT" --hostnqn=$HOSTNQN --hostid=$HOSTID 2>&1)
  rc=$?
  echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme discover failed (rc=$rc)"; return 1; }
  echo "$out" | grep -q "subnqn: *$NQN\$" || { say "subsystem $NQN not in the discovery log"; return 1; }
  echo "$out" | grep -q "trsvcid: *$PORT\$" || { say "trsvcid $PORT not in the discovery log"; return 1; }
  echo "$out" | grep -q "traddr: *$ADDR\$" || { say "traddr $ADDR not in the discovery log"; return 1; }
}
DEV=""
connect() { # [extra nvme-connect options]
  local out rc
  out=$(timeout -k 5 90 nvme connect "${COPTS[@]}" -n $NQN --hostnqn=$HOSTNQN --hostid=$HOSTID "$@" 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme connect failed (rc=$rc)"; return 1; }
  DEV=$(ns_dev) || { say "connected, but no /dev/nvmeXnY for $NQN appeared within 15 s"; DEV=""; return 1; }
  local b=${DEV#/dev/} sz lbs ctrl
  sz=$(( $(cat /sys/block/$b/size) * 512 ))
  lbs=$(cat /sys/block/$b/queue/logical_block_size)
  ctrl=$(connected_ctrls $NQN | head -1)
  say "namespace $DEV: $sz bytes, logical block $lbs; controller $ctrl: model '$(cat /sys/class/nvme/$ctrl/model 2>/dev/null | xargs)' serial '$(cat /sys/class/nvme/$ctrl/serial 2>/dev/null | xargs)' fw '$(cat /sys/class/nvme/$ctrl/firmware_rev 2>/dev/null | xargs)'"
  [ "$sz" -eq $NS_BYTES ] || { say "size $sz != expected $NS_BYTES"; return 1; }
  [ "$lbs" -eq $NS_BS ] || { say "logical block size $lbs != expected $NS_BS"; return 1; }
}
fio_randwrite() { fio_run randwrite-4k --rw=randwrite --bs=4k --size="$FIO_SIZE" --iodepth=16; }
fio_seqwrite() { fio_run seqwrite-128k --rw=write --bs=128k --size="$FIO_SIZE" --iodepth=8; }
persist_check() { # reconnect (same gateway process): the ext4 file from step d is intact
  fs_reread || return 1
  disconnect_nqn $NQN > /dev/null || return 1
  [ "$FS_GOT" = "$FS_SHA" ] || { say "sha256 MISMATCH after reconnect"; return 1; }
}
jvars() { # json-file prefix keys...: prints shell assignments PREFIX_key=value (one python3 exec: ~1 s under TCG)
  python3 - "$@" <<'PY'
import json, shlex, sys
d = json.load(open(sys.argv[1]))
for k in sys.argv[3:]:
    v = d.get(k)
    print(f"{sys.argv[2]}_{k}={shlex.quote('' if v is None else str(v).strip())}")
PY
}
admin_check() { # Identify/log/feature commands the Linux host and tools use
  local ctrl c rc=0 f=$WORK/id-ctrl.json n=$WORK/id-ns.json sysc
  ctrl=$(connected_ctrls $NQN | head -1)
  [ -n "$ctrl" ] || { say "no controller"; return 1; }
  timeout -k 5 30 nvme id-ctrl /dev/$ctrl -o json > $f 2> $WORK/err || { say "nvme id-ctrl failed: $(cat $WORK/err)"; return 1; }
  local ic_vid ic_mn ic_sn ic_fr ic_cntlid ic_mdts ic_nn ic_kas ic_ioccsz ic_iorcsz ic_sgls ic_oncs ic_vwc ic_cmic ic_subnqn ic_maxcmd
  eval "$(jvars $f ic vid mn sn fr cntlid mdts nn kas ioccsz iorcsz sgls oncs vwc cmic subnqn maxcmd)" ||
    { say "cannot parse id-ctrl JSON"; return 1; }
  sysc=$(cat /sys/class/nvme/$ctrl/cntlid)
  say "id-ctrl: vid=$ic_vid mn='$ic_mn' sn='$ic_sn' fr='$ic_fr' cntlid=$ic_cntlid mdts=$ic_mdts nn=$ic_nn kas=$ic_kas maxcmd=$ic_maxcmd ioccsz=$ic_ioccsz iorcsz=$ic_iorcsz sgls=$ic_sgls oncs=$ic_oncs vwc=$ic_vwc cmic=$ic_cmic"
  [ "$ic_subnqn" = "$NQN" ] || { say "id-ctrl subnqn '$ic_subnqn' != $NQN"; rc=1; }
  [ "$ic_cntlid" = "$((sysc))" ] || { say "id-ctrl cntlid $ic_cntlid != connect's cntlid $((sysc))"; rc=1; }
  [ "${ic_nn:-0}" -ge 1 ] 2>/dev/null || { say "id-ctrl nn < 1"; rc=1; }
  [ "${ic_kas:-0}" -ge 1 ] 2>/dev/null || { say "id-ctrl kas is 0 (Linux needs KAS != 0)"; rc=1; }
  [ "${ic_ioccsz:-0}" -ge 4 ] && [ "${ic_iorcsz:-0}" -ge 1 ] 2>/dev/null || { say "id-ctrl ioccsz < 4 or iorcsz < 1"; rc=1; }
  timeout -k 5 30 nvme id-ns "$DEV" -o json > $n 2> $WORK/err || { say "nvme id-ns failed: $(cat $WORK/err)"; return 1; }
  local in_nsze in_ncap in_nuse in_flbas in_nlbaf
  eval "$(jvars $n in nsze ncap nuse flbas nlbaf)" || { say "cannot parse id-ns JSON"; return 1; }
  say "id-ns: nsze=$in_nsze ncap=$in_ncap nuse=$in_nuse flbas=$in_flbas nlbaf=$in_nlbaf"
  [ "$in_nsze" = $((NS_BYTES / NS_BS)) ] || { say "id-ns nsze $in_nsze != $((NS_BYTES / NS_BS))"; rc=1; }
  for c in "smart-log /dev/$ctrl" "error-log /dev/$ctrl" "fw-log /dev/$ctrl" "get-feature /dev/$ctrl -f 7" \
           "get-feature /dev/$ctrl -f 0xb" "ns-descs $DEV" "list-ns /dev/$ctrl" "list-subsys -o json"; do
    local t0; t0=$(now)
    # shellcheck disable=SC2086
    if timeout -k 5 30 nvme $c > $WORK/out 2>&1; then say "nvme $c: ok ($(awk -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}')s)"
    else say "nvme $c: FAILED: $(head -c 300 $WORK/out | tr '\n' ' ')"; rc=1; fi
  done
  return $rc
}
keepalive_check() { # idle longer than KATO: controller stays live, nothing torn down
  local ctrl st torn0 torn1
  ctrl=$(connected_ctrls $NQN | head -1)
  [ -n "$ctrl" ] || { say "no controller"; return 1; }
  torn0=$(grep -c 'torn down' "$GWLOG" 2>/dev/null)
  say "idle for 15 s (the kernel's default KATO is 5 s, keep-alives every 2.5 s)"
  sleep 15
  st=$(cat /sys/class/nvme/$ctrl/state)
  torn1=$(grep -c 'torn down' "$GWLOG" 2>/dev/null)
  say "controller $ctrl state after idle: $st; gateway 'torn down' log lines: $torn0 -> $torn1"
  [ "$st" = live ] || { say "controller not live after idling"; return 1; }
  [ "${torn1:-0}" = "${torn0:-0}" ] || { say "the gateway tore a controller down while idle (keep-alive?)"; return 1; }
  timeout -k 5 60 dd if="$DEV" of=/dev/null bs=64k count=16 iflag=direct 2>/dev/null || { say "read after idle failed"; return 1; }
}
digest_check() { # header + data digests (CRC32C) negotiated and used
  connect --hdr-digest --data-digest || return 1
  fio_run digest-4k --rw=randwrite --bs=4k --size=8M --iodepth=16 || { disconnect_nqn $NQN > /dev/null; return 1; }
  fio_run digest-128k --rw=write --bs=128k --size=8M --iodepth=4 || { disconnect_nqn $NQN > /dev/null; return 1; }
  disconnect_nqn $NQN > /dev/null
}
connect_all_check() { # nvme connect-all: the discovery log offers SQ flow control off, the host takes it
  local out rc
  out=$(timeout -k 5 90 nvme connect-all "${COPTS[@]}" --hostnqn=$HOSTNQN --hostid=$HOSTID 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme connect-all failed (rc=$rc)"; return 1; }
  DEV=$(ns_dev) || { say "connect-all connected no namespace of $NQN within 15 s"; DEV=""; return 1; }
  if [ "$MODE" = gateway ]; then
    # reads now complete by their C2HData's SUCCESS flag, with no CapsuleResp
    sed 's/\x1b\[[0-9;]*m//g' "$GWLOG" | grep -q 'queue connected.*sq_flow_control=false' ||
      { say "no queue was connected with SQ flow control disabled"; disconnect_nqn $NQN > /dev/null; return 1; }
    say "the gateway log shows queues connected with SQ flow control disabled"
  fi
  fio_run connect-all-4k --rw=randwrite --bs=4k --size=8M --iodepth=16 || { disconnect_nqn $NQN > /dev/null; return 1; }
  disconnect_nqn $NQN > /dev/null
}
MPORT=$((PORT + 1000))
scrape() { # series: its value from the gateway's /metrics (bash's /dev/tcp: no curl needed)
  local reply
  exec 3<>"/dev/tcp/127.0.0.1/$MPORT" || return 1
  printf 'GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n' >&3
  reply=$(timeout 5 cat <&3)
  exec 3<&-
  echo "$reply" | awk -v s="$1" '$1 == s {print $2}'
}
budget_check() { # a 2 MiB data budget under 1 MiB writes at iodepth 32: commands wait, fio verify passes
  GW_EXTRA=$(printf '[gateway]\ntcp_data_budget = "2MiB"\nmetrics_listen = "127.0.0.1:%s"' "$MPORT")
  start_gateway data-budget || { GW_EXTRA=""; return 1; }
  GW_EXTRA=""
  connect || { stop_gateway; return 1; }
  local rc=0 waited thp=/sys/kernel/mm/transparent_hugepage/enabled was
  # fio's 32 MiB of buffers would be huge pages, and Debian's 6.1 kernel then panics in the
  # gateway's recv ("usercopy: Kernel memory exposure attempt detected from page alloc"):
  # over loopback the initiator's pages become the skb's, and a fragment may cross a huge
  # page's end. Any user-space target sharing a 6.1 kernel with the initiator meets it
  # (Mayastor issues 1330, 1693); it is the kernel's, seen with any budget.
  was=$(sed 's/.*\[\(.*\)\].*/\1/' $thp)
  echo never > $thp
  # All 32 writes go out in one io_submit: one by one, a TCG guest spends so long making each
  # 1 MiB (and its crc32c) that the gateway may have finished the last one before the next
  # arrives, and then no command ever needs to wait (seen in CI).
  fio_run budget-1m --rw=write --bs=1M --size=32M --iodepth=32 --iodepth_batch_submit=32 || rc=1
  echo "$was" > $thp
  waited=$(scrape nvmeof_tcp_commands_waited_for_buffers_total)
  say "commands that waited for the data budget: ${waited:-none scraped}; now waiting: $(scrape nvmeof_tcp_commands_waiting_for_buffers)"
  [ "${waited:-0}" -gt 0 ] || { say "no command ever waited: the budget was not exercised"; rc=1; }
  disconnect_nqn $NQN > /dev/null || rc=1
  stop_gateway || rc=1
  return $rc
}
read_check() { # after the restart: namespace readable + a small write/verify
  local rc
  timeout -k 5 60 dd if="$DEV" of=/dev/null bs=1M count=16 iflag=direct 2>&1 | tail -n 1 | sed 's/^/    dd: /'
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { say "dd read of 16 MiB failed (rc=$rc)"; return 1; }
  fio_run after-restart-4k --rw=randwrite --bs=4k --size=4M --iodepth=8
}
expect_refused() { # label nqn hostnqn hostid expected-status(hex, informational)
  local out rc n0 new ret
  n0=$(dmesg | wc -l)
  out=$(timeout -k 5 90 nvme connect "${COPTS[@]}" -n "$2" --hostnqn="$3" --hostid="$4" 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  new=$(dmesg | tail -n +$((n0 + 1)) | grep -iE 'nvme')
  [ -n "$new" ] && echo "$new" | tail -n 3 | sed 's/^/    dmesg: /'
  if [ $rc -eq 0 ] || [ -n "$(connected_ctrls "$2")" ]; then
    say "UNEXPECTED: connect to $2 as $3 succeeded"
    disconnect_nqn "$2" >/dev/null
    return 1
  fi
  [ $rc -eq 124 ] && { say "nvme connect hung until timeout instead of being refused"; return 1; }
  # the kernel logs "failed to connect queue: 0 ret=N": N > 0 is the NVMe status
  # the target answered the Connect command with, N < 0 an errno (no answer)
  ret=$(echo "$new" | sed -n 's/.*failed to connect queue: 0 ret=\(-\{0,1\}[0-9]*\).*/\1/p' | tail -n 1)
  if [ -z "$ret" ] || [ "$ret" -le 0 ]; then
    say "connect failed, but not with an NVMe status from the target (ret=${ret:-?}; -11 = no ICResp/answer, -104 = connection reset): the Connect command must be answered with an error status"
    return 1
  fi
  say "refused as expected: Connect status 0x$(printf '%x' "$ret") (SCT $(( (ret >> 8) & 7 )) SC 0x$(printf '%02x' $((ret & 0xff)))$([ $((ret & 0x4000)) -ne 0 ] && echo ', DNR'))"
  [ -n "${5:-}" ] && [ $((ret & 0x7ff)) -ne $((0x$5)) ] &&
    say "note: expected SCT/SC 0x$5 ($6), got 0x$(printf '%x' $((ret & 0x7ff)))"
  sleep 0.5
  gw_alive || { say "gateway process DIED after the refused connect"; return 1; }
  say "gateway still alive (pid ${GWPID:-kernel})"
  discover > /dev/null || { say "gateway alive but discovery no longer works"; return 1; }
  say "discovery still works"
}

cleanup() {
  delete_ctrls $NQN
  kill_gateway
  v6_cleanup
  dmesg > "$LOGDIR/dmesg.log" 2>/dev/null
}
trap cleanup EXIT

# ------------------------------------------------------------------ main --
echo "e2e-tcp: mode=$MODE guest $(uname -r), $(nproc) vCPU, nvme-cli $(nvme version 2>/dev/null | head -1 | awk '{print $3}'), logs in $LOGDIR"
[ "$MODE" = gateway ] && echo "e2e-tcp: gateway $GW"
step setup.modprobe "load the NVMe/TCP initiator" \
  eval 'modprobe -a nvme-core nvme-tcp && { [ $MODE = gateway ] || { modprobe -a nvmet nvmet-tcp && modprobe null_blk nr_devices=0; }; }'

ALL=(a.discover b.connect x1.admin-commands c1.fio-randwrite-4k c2.fio-seqwrite-128k d.ext4-sha256
  x2.keepalive-idle e1.disconnect x3.reconnect-persist e2.sigterm e3.restart e4.reconnect
  e5.read-after-restart x4.digests f.reject-unknown-host g.reject-unknown-subsys h.shutdown)
[ "$MODE" = gateway ] && ALL+=(x6.data-budget)
skip_list() { local r=$1 s; shift; for s in "$@"; do skip "$s" "$r"; done; }

if step gateway.start "start the target on $ADDR:$PORT" start_gateway first; then
  step a.discover "nvme discover lists $NQN" discover

  if step b.connect "nvme connect as allowed host, /dev/nvmeXnY has 256 MiB / 512 B blocks" connect; then
    step x1.admin-commands "id-ctrl/id-ns fields, smart/error/fw logs, features, ns-descs" admin_check
    step c1.fio-randwrite-4k "fio 4K randwrite $FIO_SIZE iodepth 16 + crc32c verify" fio_randwrite
    step c2.fio-seqwrite-128k "fio 128K sequential write $FIO_SIZE + crc32c verify" fio_seqwrite
    step d.ext4-sha256 "mkfs.ext4, 16 MiB file, remount after drop_caches, sha256 matches" fs_check
    step x2.keepalive-idle "idle 15 s > KATO: controller stays live" keepalive_check
    if step e1.disconnect "nvme disconnect" disconnect_nqn $NQN; then
      step x3.reconnect-persist "reconnect (same process): the ext4 file's sha256 is unchanged" persist_check
    else
      skip x3.reconnect-persist "disconnect failed"
    fi
  else
    skip_list "connect failed" x1.admin-commands c1.fio-randwrite-4k c2.fio-seqwrite-128k d.ext4-sha256 \
      x2.keepalive-idle e1.disconnect x3.reconnect-persist
    disconnect_nqn $NQN > /dev/null 2>&1
  fi

  if step e2.sigterm "SIGTERM: gateway exits with status 0 within 10 s" stop_gateway; then :; else
    if [ -n "$GWPID" ]; then kill -KILL "$GWPID" 2>/dev/null; wait "$GWPID" 2>/dev/null; GWPID=""; fi
  fi
  if step e3.restart "restart the gateway with the same config" start_gateway restart; then
    if step e4.reconnect "reconnect after restart" connect; then
      step e5.read-after-restart "namespace usable after restart (dd read + fio verify 4M)" read_check
      disconnect_nqn $NQN > /dev/null
    else
      skip e5.read-after-restart "reconnect failed"; disconnect_nqn $NQN > /dev/null 2>&1
    fi
    step x4.digests "connect with header+data digests (CRC32C), fio verify 4K and 128K" digest_check
    step x5.connect-all "nvme connect-all: SQ flow control disabled as the discovery log offers, fio verify 4K" \
      connect_all_check
    step f.reject-unknown-host "connect with a host NQN not in hosts[] is refused, gateway alive" \
      expect_refused bad-host $NQN $BADHOSTNQN $BADHOSTID 184 "Connect Invalid Host"
    step g.reject-unknown-subsys "connect to an unknown subsystem NQN is refused, gateway alive" \
      expect_refused bad-subsys $UNKNOWN_NQN $HOSTNQN $HOSTID 182 "Connect Invalid Parameters"
    step h.shutdown "final SIGTERM: exit status 0" stop_gateway
    if [ "$MODE" = gateway ]; then
      step x6.data-budget "2 MiB data budget: fio 1M writes at iodepth 32 + crc32c verify pass, commands waited" \
        budget_check
    fi
  else
    skip_from e4.reconnect "restart failed"
  fi
else
  skip_from a.discover "gateway did not start"
fi

ipv6_steps

cleanup; trap - EXIT
guest_summary "e2e-tcp summary (mode $MODE, guest $(uname -r), TCG)"
[ $FAIL -eq 0 ]
