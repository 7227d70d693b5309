#!/bin/bash
# e2e-rdma.sh - end-to-end test of OUR NVMe/RDMA gateway against the real Linux
# nvme-rdma initiator over Soft-RoCE (rdma_rxe). Runs INSIDE the test VM, with
# the gateway inside the guest too (RDMA cannot cross QEMU's user network):
#
#   tests/vm/run-in-vm.sh -t 900 -w target/vm-logs tests/vm/e2e-rdma.sh target/release/nvmeof-gateway
#
# usage: e2e-rdma.sh <path-to-nvmeof-gateway> [path-to-rdma-cm-probe]
#   The probe (cargo build --release -p rdma-transport --example cm_probe) sends
#   hand-made connect requests for the bad-input steps; without it they are
#   reported as not run.
#
# Steps (each timed, PASS/FAIL): modprobe + `rdma link add rxe0 type rxe netdev
# eth0`, start the gateway with an in-memory namespace on 10.0.2.15:4420 rdma
# (and 127.0.0.1:4420 tcp: one subsystem, two transports), (a) nvme discover -t
# rdma, (b) nvme connect -t rdma, (x1) Identify fields for RDMA (SGLS keyed,
# IOCCSZ), (c) fio crc32c verify: 4K randwrite and 128K sequential write, two
# jobs on two queues, (d) mkfs.ext4 + 16 MiB sha256 round trip across a
# remount, (e) disconnect: every QP closed and every pool buffer returned
# (gateway counters), reconnect (same process), data intact, (x2) a connect with
# --disable-sqflow granted and fio verify over it, (p) gateway CPU
# per I/O over RDMA vs TCP (fio 4K randread, same guest), registrations per
# I/O (the log's counters, and the Prometheus metrics on 127.0.0.1:PORT+5000:
# nvmeof_rdma_memory_registrations_while_serving_total and ..._buffer_pool_misses_total
# flat, a pool hit per read), (r) bad connect requests rejected with the NVMe/RDMA status codes,
# (f) fused Compare-and-Write from cm_probe's minimal host (in-capsule data),
# (v) the host vanishing mid-I/O (controller deleted under fio): resources
# released, gateway still serving, (m1) E2E_SRQ_CTRLS (6) controllers on the
# shared receive queue: receive memory stays at its depth, (y1) `rdma link
# delete rxe0` under fio: the kernel completes the removal (it waits for the
# gateway to close the device), no PD/MR/CQ/SRQ/QP/ID left, (y2) TCP still
# serves, (y3) `rdma link add rxe0`: the listener comes back, connect + fio,
# (w) a restart with a tiny registered pool and NVMEOF_RDMA_SRQ=0: commands
# wait for buffers (back-pressure) and fio verify still passes, (m2) receive
# memory with per-QP receive queues for the same controllers, (k1-k5, in
# e2e-rdma-rbd.sh) a micro Ceph inside the guest and a second gateway serving
# an RBD image over nvme-rdma: fio verify, rbd export byte compare
# (E2E_RDMA_RBD=0 skips them), (h) SIGTERM exits 0.
# Last line: "N passed, N failed". Exit 0 only if nothing failed.
#
# Env: E2E_LOG_DIR (default: ./target/vm-logs if writable, else /tmp/e2e-logs),
#      E2E_FIO_SIZE (default 32M), E2E_PORT (default 4420), E2E_PERF_SECONDS
#      (default 10), E2E_ONLY=perf (only the perf steps, E2E_PERF_ROUNDS rounds,
#      default 3), E2E_STRACE=1 (perf steps count the gateway's syscalls per I/O),
#      E2E_PROFILE=1 (perf steps print a perf profile of the gateway), RUST_LOG
#      (default info).
set -u
export LC_ALL=C

GW=${1:-}
PROBE=${2:-}
if [ -z "$GW" ]; then echo "usage: e2e-rdma.sh <nvmeof-gateway binary> [cm_probe]"; echo "0 passed, 1 failed"; exit 2; fi
case $GW in /*) ;; *) GW=$PWD/$GW ;; esac
if [ ! -x "$GW" ]; then echo "FAIL: gateway binary not found or not executable: $GW"; echo "0 passed, 1 failed"; exit 2; fi
if [ -n "$PROBE" ]; then case $PROBE in /*) ;; *) PROBE=$PWD/$PROBE ;; esac; fi

ADDR=10.0.2.15
TCPADDR=127.0.0.1
PORT=${E2E_PORT:-4420}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
HOSTID=11111111-2222-3333-4444-555555555555
NS_BYTES=$((256 * 1024 * 1024))
NS_BS=512
FIO_SIZE=${E2E_FIO_SIZE:-32M}
PERF_SECONDS=${E2E_PERF_SECONDS:-10}
MPORT=$((PORT + 5000))  # the gateway's Prometheus metrics (step p1 reads its registration counters)
export RUST_LOG=${RUST_LOG:-info}
export NO_COLOR=1

WORK=/tmp/e2e-rdma
mkdir -p $WORK
CONF=$WORK/gateway.toml
GWLOG=$WORK/gateway.log
COPTS=(-t rdma -a $ADDR -s "$PORT" --ctrl-loss-tmo=5 --reconnect-delay=1)

GWPID=""
GW_ENV=()  # extra environment for the gateway (pool shape for the back-pressure step)
. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh"
. "$(dirname "${BASH_SOURCE[0]}")/e2e-rdma-rbd.sh"  # RBD behind RDMA (steps k*)
guest_log_dir e2e-rdma

on_step_failure() {
  gwlog_tail 15
  dmesg | grep -iE 'nvme|rdma|rxe' | tail -n 8 | sed 's/^/    dmesg: /'
}

# ------------------------------------------------------------------- rxe --
rxe_setup() {
  # ib_uverbs first, as when a NIC driver (mlx5_ib) loads it at boot: the kernel removes a
  # device's clients in reverse order of registration, so rdma_cm (DEVICE_REMOVAL to the
  # gateway) must come after uverbs (which waits for the gateway to close the device).
  modprobe ib_uverbs && modprobe rdma_ucm || return 1
  modprobe -a nvme-core nvme-rdma nvme-tcp rdma_rxe || return 1
  local nd=eth0
  if ! ip link show eth0 > /dev/null 2>&1; then
    ip link add dummy0 type dummy && ip addr add $ADDR/24 dev dummy0 && ip link set dummy0 up || return 1
    nd=dummy0
  fi
  rdma link add rxe0 type rxe netdev $nd || return 1
  # A second device (no address) for the removal step: librdmacm 44 re-reads its device list,
  # and so closes a removed device's context, only while at least one device is present.
  ip link add dummy1 type dummy 2>/dev/null; ip link set dummy1 up
  rdma link add rxe1 type rxe netdev dummy1 || say "no second rxe device: the removal step will wait"
  rdma link show | sed 's/^/    /'
  ibv_devices 2>&1 | sed 's/^/    /'
  for _ in $(seq 50); do rdma link show rxe0/1 2>/dev/null | grep -q ACTIVE && return 0; sleep 0.1; done
  say "rxe0 port not ACTIVE"
  return 1
}

# ---------------------------------------------------------------- target --
write_config() {
  cat > "$CONF" <<EOF
[gateway]
metrics_listen = "$TCPADDR:$MPORT"

[[listener]]
transport = "rdma"
address = "$ADDR"
port = $PORT

[[listener]]
transport = "tcp"
address = "$TCPADDR"
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
gw_alive() { [ -n "$GWPID" ] && kill -0 "$GWPID" 2>/dev/null; }
start_gateway() {
  write_config
  say "$GW --config $CONF  (RUST_LOG=$RUST_LOG, log $GWLOG)"
  echo "----- gateway start ${1:-} at guest uptime $(now) -----" >> "$GWLOG"
  env "${GW_ENV[@]}" "$GW" --config "$CONF" >> "$GWLOG" 2>&1 < /dev/null &
  GWPID=$!
  say "gateway pid $GWPID"
  for _ in $(seq 150); do
    if [ "$(grep -c 'NVMe/RDMA listener ready' "$GWLOG")" -ge "${2:-1}" ]; then
      grep 'RDMA device ready' "$GWLOG" | tail -n 1 | sed 's/^/    /'
      say "listening on rdma $ADDR:$PORT"; return 0
    fi
    gw_alive || { say "gateway exited during startup: $(wait "$GWPID"; echo "exit status $?")"; GWPID=""; return 1; }
    sleep 0.1
  done
  say "no 'NVMe/RDMA listener ready' after 15 s"
  return 1
}
stop_gateway() { sigterm_gateway && [ "$GW_STATUS" -eq 0 ]; }
# Counters logged by the gateway when a queue pair closes (last line).
last_counters() { grep 'queue pair closed' "$GWLOG" | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g'; }
counter() { # name [line]: value of name=N in the last counters line
  local line=${2:-$(last_counters)}
  echo "$line" | sed -n "s/.*[ =]$1=\([0-9]*\).*/\1/p" | head -n 1
}
released_check() { # after every controller is gone: no QP alive, no pool buffer on loan
  local line q l
  for _ in $(seq 100); do
    line=$(last_counters)
    q=$(counter live_qps "$line"); l=$(counter on_loan "$line")
    [ "$q" = 0 ] && [ "$l" = 0 ] && break
    sleep 0.1
  done
  say "counters: $(echo "$line" | sed 's/.*queue pair closed//')"
  [ "$q" = 0 ] || { say "live_qps=$q after the host disconnected"; return 1; }
  [ "$l" = 0 ] || { say "on_loan=$l pool buffers not returned"; return 1; }
}

# ------------------------------------------------------------- initiator --
discover() {
  local out rc
  out=$(timeout -k 5 60 nvme discover -t rdma -a $ADDR -s "$PORT" --hostnqn=$HOSTNQN --hostid=$HOSTID 2>&1)
  rc=$?
  echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme discover failed (rc=$rc)"; return 1; }
  echo "$out" | grep -q "subnqn: *$NQN\$" || { say "subsystem $NQN not in the discovery log"; return 1; }
  echo "$out" | grep -q "trtype: *rdma" || { say "no trtype rdma entry"; return 1; }
  echo "$out" | grep -q "trtype: *tcp" || { say "no trtype tcp entry (same subsystem over TCP)"; return 1; }
  echo "$out" | grep -q "traddr: *$ADDR\$" || { say "traddr $ADDR not in the discovery log"; return 1; }
}
DEV=""
connect() { # [transport options...]
  local out rc opts=("${COPTS[@]}")
  [ $# -gt 0 ] && opts=("$@")
  out=$(timeout -k 5 90 nvme connect "${opts[@]}" -n $NQN --hostnqn=$HOSTNQN --hostid=$HOSTID 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme connect failed (rc=$rc)"; return 1; }
  DEV=$(ns_dev) || { say "connected, but no /dev/nvmeXnY for $NQN appeared within 15 s"; DEV=""; return 1; }
  local b=${DEV#/dev/} sz ctrl
  sz=$(( $(cat /sys/block/$b/size) * 512 ))
  ctrl=$(connected_ctrls $NQN | head -1)
  say "namespace $DEV: $sz bytes; controller $ctrl transport $(cat /sys/class/nvme/$ctrl/transport) address '$(cat /sys/class/nvme/$ctrl/address)'; $(ls -d /sys/class/nvme/$ctrl/nvme*n*/mq/* 2>/dev/null | wc -l) blk-mq hw queues"
  [ "$sz" -eq $NS_BYTES ] || { say "size $sz != expected $NS_BYTES"; return 1; }
}
identify_check() {
  local ctrl f=$WORK/id-ctrl.json
  ctrl=$(connected_ctrls $NQN | head -1)
  timeout -k 5 30 nvme id-ctrl /dev/$ctrl -o json > $f 2> $WORK/err || { say "nvme id-ctrl failed: $(cat $WORK/err)"; return 1; }
  local vals
  vals=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["sgls"], d["ioccsz"], d["iorcsz"], d["icdoff"], d["msdbd"], d["mdts"])' $f) || return 1
  read -r sgls ioccsz iorcsz icdoff msdbd mdts <<< "$vals"
  say "id-ctrl: sgls=$(printf '%#x' "$sgls") ioccsz=$ioccsz iorcsz=$iorcsz icdoff=$icdoff msdbd=$msdbd mdts=$mdts"
  [ $((sgls & 4)) -ne 0 ] || { say "SGLS keyed bit (2) not set"; return 1; }
  [ "$ioccsz" -eq 516 ] || { say "IOCCSZ $ioccsz != 516 (8 KiB in-capsule data)"; return 1; }
  [ "$msdbd" -ge 1 ] || { say "MSDBD 0"; return 1; }
}
HALF=$(( $(numfmt --from=iec "$FIO_SIZE") / 2 ))
# two jobs (the guest has 2 vCPUs: one nvme-rdma I/O queue each), disjoint halves
fio_randwrite() { fio_run randwrite-4k --rw=randwrite --bs=4k --size=$HALF --offset_increment=$HALF --numjobs=2 --iodepth=16; }
fio_seqwrite() { fio_run seqwrite-128k --rw=write --bs=128k --size=$HALF --offset_increment=$HALF --numjobs=2 --iodepth=8; }
idle_cpu() { # a connected, idle controller costs (almost) no gateway CPU: no busy polling
  local c0 c1 u0 s0 u1 s1 hz pct
  hz=$(getconf CLK_TCK)
  sleep 1
  c0=$(gw_cpu_ticks)
  sleep 10
  c1=$(gw_cpu_ticks)
  read -r u0 s0 <<< "$c0"; read -r u1 s1 <<< "$c1"
  pct=$(awk -v t=$((u1 + s1 - u0 - s0)) -v hz="$hz" 'BEGIN{printf "%.1f", t * 100 / hz / 10}')
  say "gateway CPU over 10 s idle with a connected controller (keep-alives only): ${pct}% of one core"
  awk -v p="$pct" 'BEGIN{exit !(p < 5)}' || { say "more than 5%: something polls"; return 1; }
}
sqflow_check() { # what nvme connect-all asks for, as the discovery log offers it
  connect "${COPTS[@]}" --disable-sqflow || return 1
  sed 's/\x1b\[[0-9;]*m//g' "$GWLOG" | grep -q 'queue connected.*sq_flow_control=false' ||
    { say "no queue was connected with SQ flow control disabled"; disconnect_nqn $NQN > /dev/null; return 1; }
  say "the gateway log shows queues connected with SQ flow control disabled"
  fio_run sqflow-4k --rw=randwrite --bs=4k --size=4M --iodepth=16 || { disconnect_nqn $NQN > /dev/null; return 1; }
  disconnect_nqn $NQN > /dev/null
}
persist_check() {
  fs_reread || return 1
  [ "$FS_GOT" = "$FS_SHA" ] || { say "sha256 MISMATCH after reconnect"; return 1; }
}

# ------------------------------------------------------------------ perf --
gw_cpu_ticks() { awk '{print $14, $15}' /proc/$GWPID/stat; }  # utime stime
PERF_RDMA="" PERF_TCP=""
perf_run() { # label -> prints "iops cpu_us_per_io user_us_per_io sys_us_per_io"
  local label=$1 out=$WORK/perf-$1.json c0 c1 ios hz
  hz=$(getconf CLK_TCK)
  local spid=""
  if [ "${E2E_STRACE:-0}" = 1 ]; then  # syscalls per I/O (strace slows the gateway: CPU figures are then void)
    strace -f -c -p "$GWPID" -o "$WORK/strace-$label.txt" 2>/dev/null & spid=$!
    sleep 1
  fi
  local ppid=""
  if [ "${E2E_PROFILE:-0}" = 1 ]; then  # where the gateway's CPU goes (perf, cpu-clock samples)
    perf record -q -F 999 -e cpu-clock -p "$GWPID" -o "$WORK/perf-$label.data" -- sleep "$PERF_SECONDS" > /dev/null 2>&1 & ppid=$!
  fi
  c0=$(gw_cpu_ticks)
  (cd /tmp && timeout -k 10 120 fio --name="$label" --filename="$DEV" --direct=1 --ioengine=libaio \
     --rw=randread --bs=4k --iodepth=16 --numjobs=1 --time_based --runtime="$PERF_SECONDS" \
     --output-format=json) > "$out" 2> $WORK/perf-err || { say "fio failed: $(cat $WORK/perf-err)"; return 1; }
  c1=$(gw_cpu_ticks)
  if [ -n "$ppid" ]; then
    wait $ppid 2>/dev/null
    echo "    $label: gateway profile (cpu-clock samples, by DSO and symbol):" >&2
    perf report -q -i "$WORK/perf-$label.data" --stdio --no-children --sort dso,sym 2>/dev/null |
      awk 'NF' | head -n 25 | sed 's/^/      /' >&2
    perf report -q -i "$WORK/perf-$label.data" --stdio --no-children --sort dso 2>/dev/null |
      awk 'NF' | head -n 8 | sed 's/^/      dso: /' >&2
  fi
  if [ -n "$spid" ]; then
    kill -INT $spid; wait $spid 2>/dev/null
    cp "$WORK/strace-$label.txt" "$LOGDIR/" 2>/dev/null
    local calls; calls=$(awk '$NF == "total" {print $4}' "$WORK/strace-$label.txt")
    local n; n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["jobs"][0]["read"]["total_ios"])' "$out")
    echo "    $label: $calls gateway syscalls for $n I/Os: $(awk -v c="$calls" -v n="$n" 'BEGIN{printf "%.2f", c/n}') per I/O; top:" >&2
    sort -k4 -n -r "$WORK/strace-$label.txt" | awk 'NF >= 5 && $NF != "total" && $1 ~ /^[0-9.]+$/' | head -n 6 | sed 's/^/      /' >&2
  fi
  cp "$out" "$LOGDIR/" 2>/dev/null
  ios=$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["read"]; print(j["total_ios"], round(j["iops"]))' "$out") || return 1
  read -r total iops <<< "$ios"
  [ "$total" -gt 0 ] || { say "no I/O completed"; return 1; }
  read -r u0 s0 <<< "$c0"; read -r u1 s1 <<< "$c1"
  awk -v t="$total" -v i="$iops" -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v hz="$hz" \
    'BEGIN{printf "%d %.1f %.1f %.1f\n", i, (u + s) * 1e6 / hz / t, u * 1e6 / hz / t, s * 1e6 / hz / t}'
}
perf_say() { # label "iops total user sys"
  local i t u s; read -r i t u s <<< "$2"
  say "$1 4K randread QD16: $i IOPS; gateway CPU per I/O: $t us (user $u us, system $s us: system time includes Soft-RoCE's packet work done in the gateway's post/poll calls)"
}
metric() { # name: its value in a scrape of the gateway's metrics (empty if absent)
  curl -s --max-time 10 "http://$TCPADDR:$MPORT/metrics" | awk -v n="$1" '$1 == n {print $2}'
}
perf_rdma() {
  local r reg0 reg1 line0 line1 ios m0 m1 h0 h1 mi0 mi1
  line0=$(last_counters)
  m0=$(metric nvmeof_rdma_memory_registrations_while_serving_total) h0=$(metric nvmeof_rdma_buffer_pool_hits_total)
  mi0=$(metric nvmeof_rdma_buffer_pool_misses_total)
  connect || return 1
  r=$(perf_run rdma) || { disconnect_nqn $NQN > /dev/null; return 1; }
  PERF_RDMA=$r
  disconnect_nqn $NQN > /dev/null || return 1
  sleep 1
  line1=$(last_counters)
  reg0=$(counter registrations "$line0"); reg1=$(counter registrations "$line1")
  ios=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["jobs"][0]["read"]["total_ios"])' $WORK/perf-rdma.json)
  perf_say RDMA "$r"
  say "registrations during the run: $((reg1 - reg0)) for $ios reads; payload copies: $(counter payload_copies "$line1") bytes; unregistered buffers: $(counter unregistered_buffers "$line1")"
  [ $((reg1 - reg0)) -eq 0 ] || { say "registrations in steady state"; return 1; }
  [ "$(counter payload_copies "$line1")" = 0 ] || { say "payload copied"; return 1; }
  # the same from the Prometheus metrics: no registration while serving, a pool hit per read
  m1=$(metric nvmeof_rdma_memory_registrations_while_serving_total) h1=$(metric nvmeof_rdma_buffer_pool_hits_total)
  mi1=$(metric nvmeof_rdma_buffer_pool_misses_total)
  [ -n "$m0" ] && [ -n "$m1" ] && [ -n "$h1" ] && [ -n "$mi1" ] || { say "no nvmeof_rdma_* registration metrics at http://$TCPADDR:$MPORT/metrics"; return 1; }
  say "metrics: registrations while serving $m0 -> $m1, pool hits $h0 -> $h1, misses $mi0 -> $mi1, registered bytes $(metric nvmeof_rdma_registered_bytes)"
  [ "$m1" = "$m0" ] || { say "nvmeof_rdma_memory_registrations_while_serving_total grew during the run"; return 1; }
  [ "$mi1" = "$mi0" ] || { say "nvmeof_rdma_buffer_pool_misses_total grew during the run"; return 1; }
  [ $((h1 - h0)) -ge "$ios" ] || { say "fewer pool hits ($((h1 - h0))) than reads ($ios)"; return 1; }
}
perf_tcp() {
  local r
  connect -t tcp -a $TCPADDR -s "$PORT" --ctrl-loss-tmo=5 --reconnect-delay=1 || return 1
  r=$(perf_run tcp) || { disconnect_nqn $NQN > /dev/null; return 1; }
  PERF_TCP=$r
  disconnect_nqn $NQN > /dev/null || return 1
  perf_say "TCP " "$r"
  [ -n "$PERF_RDMA" ] && say "ratio gateway CPU/IO rdma/tcp: $(echo "$PERF_RDMA $r" | awk '{printf "total %.2f, user %.2f, system %.2f", $2/$6, $3/$7, $4/$8}')"
  return 0
}

# ------------------------------------------------------------- bad input --
probe() { # expect-status hex-private-data: a connect request the gateway must reject with status
  local want=$1 pd=$2 out
  out=$(timeout -k 5 30 "$PROBE" $ADDR "$PORT" "$pd" 2>&1)
  say "probe $pd -> $out"
  case $out in "rejected status=$want"*) return 0 ;; esac
  say "expected 'rejected status=$want'"
  return 1
}
bad_connect_requests() {
  [ -n "$PROBE" ] && [ -x "$PROBE" ] || { say "no cm_probe binary given"; return 1; }
  local rc=0 r0 r1
  r0=$(grep -c 'connect request rejected' "$GWLOG")
  # recfmt qid hrqsize hsqsize cntlid (little endian), 32 bytes in all
  # (the IB CM pads REQ private data to 56 bytes: a short request reads as zero sizes)
  probe 4 "0000" || rc=1                                                   # hsqsize 0: INVALID_HSQSIZE
  probe 2 "0100000020001f00ffff$(printf '0%.0s' $(seq 44))" || rc=1         # recfmt 1: INVALID_RECFMT
  probe 4 "0000000020002000ffff$(printf '0%.0s' $(seq 44))" || rc=1         # admin hsqsize 32: INVALID_HSQSIZE
  probe 4 "0000010080000004ffff$(printf '0%.0s' $(seq 44))" || rc=1         # hsqsize 1024 > MQES
  probe 5 "000001000000ff00ffff$(printf '0%.0s' $(seq 44))" || rc=1         # hrqsize 0: INVALID_HRQSIZE
  local out
  out=$(timeout -k 5 30 "$PROBE" $ADDR "$PORT" --no-ird 2>&1)                 # no RDMA READ resources: INVALID_IRD
  say "probe --no-ird -> $out"
  [ "$out" = "rejected status=7" ] || { say "expected 'rejected status=7'"; rc=1; }
  r1=$(grep -c 'connect request rejected' "$GWLOG")
  say "gateway logged $((r1 - r0)) rejections"
  gw_alive || { say "gateway died"; return 1; }
  discover > /dev/null || { say "discovery no longer works"; return 1; }
  return $rc
}
bad_sgls() { # a keyed SGL beyond MDTS is refused without a transfer; a bogus rkey drops only that QP
  [ -n "$PROBE" ] && [ -x "$PROBE" ] || { say "no cm_probe binary given"; return 1; }
  local out rc=0 st e0 e1
  out=$(timeout -k 5 30 "$PROBE" $ADDR "$PORT" --beyond-mdts 2>&1)
  say "probe --beyond-mdts (2 MiB keyed SGL, MDTS 1 MiB) -> $out"
  st=$(echo "$out" | sed -n 's/^status=\(0x[0-9a-f]*\)$/\1/p')
  if [ -z "$st" ] || [ $((st & 0x7ff)) -ne 2 ]; then say "expected status Invalid Field (0x2)"; rc=1; fi
  e0=$(counter wc_errors)
  out=$(timeout -k 5 30 "$PROBE" $ADDR "$PORT" --bogus-rkey 2>&1)
  say "probe --bogus-rkey (Connect data behind an unregistered key) -> $out"
  [ "$out" = disconnected ] || { say "expected the gateway to drop the queue pair"; rc=1; }
  sleep 1
  released_check || rc=1
  e1=$(counter wc_errors)
  say "gateway work-completion errors: $e0 -> $e1"
  gw_alive || { say "gateway died"; return 1; }
  discover > /dev/null || { say "discovery no longer works"; return 1; }
  return $rc
}
fused_cw() { # fused Compare-and-Write over RDMA (the kernel initiator never sends fused commands)
  [ -n "$PROBE" ] && [ -x "$PROBE" ] || { say "no cm_probe binary given"; return 1; }
  local out rc
  out=$(timeout -k 5 60 "$PROBE" $ADDR "$PORT" --fused-cw $NQN $HOSTNQN $HOSTID 2>&1); rc=$?
  echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] && [ "$(echo "$out" | tail -n 1)" = "fused ok" ] || return 1
  sleep 1
  released_check
}
vanish_check() { # the host goes away mid-I/O: resources released, gateway keeps serving
  connect || return 1
  local ctrl
  ctrl=$(connected_ctrls $NQN | head -1)
  (cd /tmp && timeout -k 5 60 fio --name=vanish --filename="$DEV" --direct=1 --ioengine=libaio \
     --rw=randrw --bs=64k --iodepth=32 --time_based --runtime=30 > $WORK/fio-vanish.log 2>&1) &
  local fpid=$!
  sleep 3
  say "deleting controller $ctrl under load"
  echo 1 > /sys/class/nvme/$ctrl/delete_controller
  wait $fpid
  for _ in $(seq 150); do [ -z "$(connected_ctrls "$NQN")" ] && break; sleep 0.1; done
  sleep 1
  released_check || return 1
  gw_alive || { say "gateway died"; return 1; }
  connect || { say "cannot connect again"; return 1; }
  fio_run after-vanish --rw=randwrite --bs=4k --size=4M --iodepth=8 || return 1
  disconnect_nqn $NQN > /dev/null
  released_check
}

back_pressure() { # a tiny data pool: commands wait for buffers, none fails
  stop_gateway || return 1
  GW_ENV=(NVMEOF_RDMA_POOL=4096x4,131072x2 NVMEOF_RDMA_CACHE_MIB=1 NVMEOF_RDMA_SRQ=0)
  say "restarting with ${GW_ENV[*]}"
  start_gateway tiny-pool 2 || return 1
  connect || return 1
  local rc=0 line w
  fio_run tiny-pool-4k --rw=randwrite --bs=4k --size=4M --offset_increment=4M --numjobs=2 --iodepth=32 || rc=1
  fio_run tiny-pool-128k --rw=write --bs=128k --size=8M --offset_increment=8M --numjobs=2 --iodepth=16 || rc=1
  disconnect_nqn $NQN > /dev/null || rc=1
  sleep 1
  released_check || rc=1
  line=$(last_counters)
  w=$(counter buffer_waits "$line")
  say "buffer_waits=$w exhaustion=$(counter exhaustion "$line") unregistered_buffers=$(counter unregistered_buffers "$line")"
  [ "${w:-0}" -gt 0 ] || { say "the pool was never exhausted: the step proves nothing"; rc=1; }
  return $rc
}

# ------------------------------------------------- shared receive queue --
SRQ_CTRLS=${E2E_SRQ_CTRLS:-6}
MEM_SRQ="" MEM_NOSRQ=""
recv_memory() { # label: connect SRQ_CTRLS controllers (admin + I/O queues each), write on each, disconnect
  local i n=0 line qps a0
  a0=$(counter accepted)
  # Straight to the kernel: nvme-cli 2.3 refuses a second controller to the same address
  # ("already connected") even with --duplicate-connect.
  local opts="transport=rdma,traddr=$ADDR,trsvcid=$PORT,nqn=$NQN,hostnqn=$HOSTNQN,hostid=$HOSTID"
  opts="$opts,duplicate_connect,ctrl_loss_tmo=5,reconnect_delay=1"
  for i in $(seq "$SRQ_CTRLS"); do
    if ! timeout -k 5 90 bash -c 'exec 3<>/dev/nvme-fabrics && printf "%s" "$1" >&3 && read -r -t 60 r <&3 && echo "$r"' _ "$opts" > $WORK/err 2>&1; then
      say "connect $i failed: $(cat $WORK/err)"; break
    fi
    n=$i
  done
  say "$n controllers connected: $(connected_ctrls $NQN | tr '\n' ' ')"
  DEV=$(ns_dev) && fio_run "recv-$1" --rw=randwrite --bs=4k --size=4M --iodepth=16 || { disconnect_nqn $NQN > /dev/null; return 1; }
  disconnect_nqn $NQN > /dev/null || return 1
  sleep 1
  line=$(last_counters)
  qps=$(( $(counter accepted "$line") - ${a0:-0} ))
  say "receive side after $n controllers ($qps queue pairs accepted): $(echo "$line" | grep -o 'recv_[a-z_]*=[0-9]*\|srq_[a-z]*=[0-9]*' | tr '\n' ' ')"
  echo "$(counter recv_bytes "$line") $(counter recv_live_registrations "$line") $n $qps"
  [ "$n" -eq "$SRQ_CTRLS" ]
}
srq_memory() { # the default gateway: receive memory stays at the SRQ's depth
  local line0 r depth
  line0=$(grep 'RDMA device ready' "$GWLOG" | tail -n 1)
  depth=$(counter srq_depth "$line0")
  [ "${depth:-0}" -gt 0 ] || { say "no shared receive queue on this device ($line0)"; return 1; }
  say "at start: recv_bytes=$(counter recv_bytes "$line0") srq_depth=$depth srq_posted=$(counter srq_posted "$line0")"
  r=$(recv_memory srq) || { echo "$r" | sed '$d'; return 1; }
  echo "$r" | sed '$d'
  MEM_SRQ=$(echo "$r" | tail -n 1)
  local line; line=$(last_counters)
  [ "$(counter srq_posted "$line")" = "$depth" ] || { say "srq_posted=$(counter srq_posted "$line") != depth $depth after every QP closed"; return 1; }
  [ "$(counter recv_bytes "$line")" = "$(counter recv_bytes "$line0")" ] || { say "receive memory grew with the queues"; return 1; }
}
nosrq_memory() { # NVMEOF_RDMA_SRQ=0: one receive queue per QP, receive memory grows with the queues
  local r b1 b0 n q
  r=$(recv_memory nosrq) || { echo "$r" | sed '$d'; return 1; }
  echo "$r" | sed '$d'
  MEM_NOSRQ=$(echo "$r" | tail -n 1)
  read -r b1 _ n q <<< "$MEM_NOSRQ"
  if [ -n "$MEM_SRQ" ]; then
    read -r b0 _ _ _ <<< "$MEM_SRQ"
    say "receive memory with $n controllers ($q queue pairs): SRQ $((b0 / 1024)) KiB, per-QP receive queues $((b1 / 1024)) KiB ($(awk -v a="$b1" -v b="$b0" 'BEGIN{printf "%.1f", a/b}')x)"
    [ "$b1" -gt "$b0" ] || { say "per-QP receives did not use more memory than the SRQ"; return 1; }
  fi
}

# ------------------------------------------------------- device removal --
DEL_PID=""
device_removal() { # rdma link delete rxe0 with a host connected: everything released, TCP serves on
  connect || return 1
  (cd /tmp && timeout -k 5 60 fio --name=removal --filename="$DEV" --direct=1 --ioengine=libaio \
     --rw=randwrite --bs=4k --iodepth=16 --time_based --runtime=20 > $WORK/fio-removal.log 2>&1) &
  local fpid=$! t0 i line
  sleep 2
  t0=$(now)
  rdma link delete rxe0 & DEL_PID=$!
  for i in $(seq 600); do kill -0 $DEL_PID 2>/dev/null || break; sleep 0.1; done
  if kill -0 $DEL_PID 2>/dev/null; then
    say "rdma link delete rxe0 still waiting after 60 s: the gateway did not release the device"
    return 1
  fi
  wait $DEL_PID; local rc=$?; DEL_PID=""
  say "rdma link delete rxe0: exit $rc after $(awk -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}') s (the kernel waits until the gateway has closed the device)"
  [ $rc -eq 0 ] || return 1
  wait $fpid
  for i in $(seq 100); do grep -q 'verbs objects after the removal' "$GWLOG" && break; sleep 0.1; done
  grep -E 'RDMA device removed|RDMA device released|verbs objects after the removal|removed RDMA device handed back' "$GWLOG" | tail -n 4 | sed 's/\x1b\[[0-9;]*m//g; s/^.*INFO //; s/^.*WARN //; s/^/    /'
  line=$(grep 'RDMA device released' "$GWLOG" | tail -n 1)
  [ "$(counter on_loan "$line")" = 0 ] || { say "data buffers on loan at release"; return 1; }
  [ "$(counter recv_on_loan "$line")" = 0 ] || { say "receive buffers on loan at release"; return 1; }
  line=$(grep 'verbs objects after the removal' "$GWLOG" | tail -n 1)
  for c in live_pds live_mrs live_comp_channels live_cqs live_srqs live_qp_objects live_cm_ids; do
    [ "$(counter $c "$line")" = 0 ] || { say "$c=$(counter $c "$line") after the removal"; return 1; }
  done
  gw_alive || { say "gateway died"; return 1; }
  for i in $(seq 150); do [ -z "$(connected_ctrls "$NQN")" ] && break; sleep 0.1; done
}
tcp_after_removal() {
  connect -t tcp -a $TCPADDR -s "$PORT" --ctrl-loss-tmo=5 --reconnect-delay=1 || return 1
  fio_run tcp-after-removal --rw=randwrite --bs=4k --size=4M --iodepth=8 || { disconnect_nqn $NQN > /dev/null; return 1; }
  disconnect_nqn $NQN > /dev/null
}
device_readd() { # rdma link add rxe0 again: the listener comes back, a host connects and writes
  rdma link add rxe0 type rxe netdev eth0 || return 1
  local i
  for i in $(seq 50); do rdma link show rxe0/1 2>/dev/null | grep -q ACTIVE && break; sleep 0.1; done
  for i in $(seq 150); do grep -q 'NVMe/RDMA listener back' "$GWLOG" && break; sleep 0.1; done
  grep -q 'NVMe/RDMA listener back' "$GWLOG" || { say "the listener did not come back within 15 s"; return 1; }
  say "listener back after $(awk -v i="$i" 'BEGIN{printf "%.1f", i/10}') s"
  connect || return 1
  fio_run after-readd --rw=randwrite --bs=4k --size=4M --iodepth=8 || { disconnect_nqn $NQN > /dev/null; return 1; }
  disconnect_nqn $NQN > /dev/null || return 1
  sleep 1
  released_check
}

cleanup() {
  rbd_cleanup
  delete_ctrls $NQN
  kill_gateway
  dmesg > "$LOGDIR/dmesg.log" 2>/dev/null
}
trap cleanup EXIT

# ------------------------------------------------------------------ main --
echo "e2e-rdma: guest $(uname -r), $(nproc) vCPU, nvme-cli $(nvme version 2>/dev/null | head -1 | awk '{print $3}'), logs in $LOGDIR"
echo "e2e-rdma: gateway $GW${PROBE:+, probe $PROBE}"
ALL=(a.discover b.connect x1.identify-rdma c1.fio-randwrite-4k c2.fio-seqwrite-128k d.ext4-sha256
  e1.disconnect e2.released e3.reconnect-persist i.idle-cpu p1.perf-rdma p2.perf-tcp r.bad-connect-requests
  s.bad-sgls f.fused-compare-write v.host-vanishes m1.srq-memory y1.device-removal y2.tcp-after-removal y3.device-readd
  w.back-pressure m2.no-srq-memory k1.rbd-ceph k2.rbd-gateway k3.rbd-fio k4.rbd-export k5.rbd-stop
  h.shutdown)

if [ "${E2E_ONLY:-}" = perf ]; then
  # Perf only: alternate RDMA and TCP rounds (the machine is shared: single rounds are noisy).
  ALL=(gateway.start)
  if step setup.rxe "rdma link add rxe0" rxe_setup && step gateway.start "start the gateway" start_gateway perf; then
    ROUNDS=()
    for r in $(seq "${E2E_PERF_ROUNDS:-3}"); do
      step p1.perf-rdma-$r "round $r: RDMA" perf_rdma && step p2.perf-tcp-$r "round $r: TCP" perf_tcp &&
        ROUNDS+=("round $r: rdma $PERF_RDMA; tcp $PERF_TCP")
    done
    stop_gateway
    echo "perf rounds (4K randread QD16; IOPS, gateway CPU us/IO total user system):"
    printf '  %s\n' "${ROUNDS[@]}"
  fi
  cleanup; trap - EXIT
  echo "$PASS passed, $FAIL failed"
  [ $FAIL -eq 0 ]; exit
fi

if ! step setup.rxe "modprobe nvme-rdma rdma_rxe, rdma link add rxe0 type rxe netdev eth0" rxe_setup; then
  skip gateway.start "no rxe device"; skip_from a.discover "no rxe device"
elif step gateway.start "start the gateway: rdma $ADDR:$PORT + tcp $TCPADDR:$PORT" start_gateway first; then
  step a.discover "nvme discover -t rdma lists $NQN (rdma and tcp entries)" discover
  if step b.connect "nvme connect -t rdma, /dev/nvmeXnY has 256 MiB" connect; then
    step x1.identify-rdma "Identify: SGLS keyed, IOCCSZ 516, MSDBD" identify_check
    step c1.fio-randwrite-4k "fio 4K randwrite 2 jobs x $HALF iodepth 16 + crc32c verify" fio_randwrite
    step c2.fio-seqwrite-128k "fio 128K sequential write 2 jobs x $HALF + crc32c verify" fio_seqwrite
    step d.ext4-sha256 "mkfs.ext4, 16 MiB file, remount after drop_caches, sha256 matches" fs_check
    if step e1.disconnect "nvme disconnect" disconnect_nqn $NQN; then
      step e2.released "every queue pair closed, every pool buffer returned" released_check
      step e3.reconnect-persist "reconnect (same process): the ext4 file's sha256 is unchanged" persist_check
      step i.idle-cpu "connected and idle for 10 s: gateway CPU < 5% of a core (event-driven completions)" idle_cpu
      disconnect_nqn $NQN > /dev/null
    else
      skip e2.released "disconnect failed"; skip e3.reconnect-persist "disconnect failed"; skip i.idle-cpu "disconnect failed"
    fi
  else
    for s in x1.identify-rdma c1.fio-randwrite-4k c2.fio-seqwrite-128k d.ext4-sha256 e1.disconnect e2.released e3.reconnect-persist i.idle-cpu; do
      skip $s "connect failed"
    done
    disconnect_nqn $NQN > /dev/null 2>&1
  fi
  step x2.disable-sqflow "nvme connect -t rdma --disable-sqflow: granted, fio verify 4K" sqflow_check
  step p1.perf-rdma "fio 4K randread QD16 ${PERF_SECONDS}s over RDMA: gateway CPU/IO, registrations/IO = 0" perf_rdma
  step p2.perf-tcp "same over TCP $TCPADDR (same subsystem, same guest)" perf_tcp
  step r.bad-connect-requests "bad private data / queue sizes rejected with NVMe/RDMA codes, gateway alive" bad_connect_requests
  step s.bad-sgls "keyed SGL beyond MDTS refused (Invalid Field), bogus rkey drops only that QP, all released" bad_sgls
  step f.fused-compare-write "fused Compare+Write over RDMA (cm_probe host, in-capsule data): applied when equal, nothing written on a miscompare" fused_cw
  step v.host-vanishes "controller deleted under fio: QPs and buffers released, gateway serves again" vanish_check
  step m1.srq-memory "$SRQ_CTRLS controllers on the shared receive queue: receive memory does not grow, every receive back in the SRQ" srq_memory
  if step y1.device-removal "rdma link delete rxe0 under fio: the kernel completes the removal, every PD/MR/CQ/SRQ/QP/ID released" device_removal; then
    step y2.tcp-after-removal "TCP still serves after the RDMA device is gone (fio verify)" tcp_after_removal
    step y3.device-readd "rdma link add rxe0 again: listener back, connect, fio verify, all released" device_readd
  else
    skip y2.tcp-after-removal "removal failed"; skip y3.device-readd "removal failed"
  fi
  step w.back-pressure "restart with a tiny data pool, no SRQ: fio verify passes, commands waited for buffers" back_pressure
  step m2.no-srq-memory "NVMEOF_RDMA_SRQ=0, $SRQ_CTRLS controllers: receive memory per QP, compared with the SRQ" nosrq_memory
  if [ "${E2E_RDMA_RBD:-1}" = 1 ]; then rbd_steps; else
    for s in k1.rbd-ceph k2.rbd-gateway k3.rbd-fio k4.rbd-export k5.rbd-stop; do skip $s "E2E_RDMA_RBD=0"; done
  fi
  step h.shutdown "SIGTERM: exit status 0" stop_gateway
else
  skip_from a.discover "gateway did not start"
fi

cleanup; trap - EXIT
figures() {
  [ -n "$PERF_RDMA" ] && echo "perf (4K randread QD16; IOPS, gateway CPU us/IO total user system): rdma $PERF_RDMA; tcp $PERF_TCP"
  [ -n "$MEM_SRQ$MEM_NOSRQ" ] && echo "receive memory (bytes registered, registrations, controllers, queue pairs): srq $MEM_SRQ; per-QP $MEM_NOSRQ"
  return 0
}
guest_summary "e2e-rdma summary (guest $(uname -r), TCG, Soft-RoCE)" figures
[ $FAIL -eq 0 ]
