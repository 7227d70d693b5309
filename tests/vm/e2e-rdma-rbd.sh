# shellcheck shell=bash
# e2e-rdma-rbd.sh - RBD behind NVMe/RDMA, sourced by tests/vm/e2e-rdma.sh (uses its helpers:
# say, step, fio_run, ns_dev, connected_ctrls, disconnect_nqn, counter from steps.sh, guest-lib.sh and it). Ceph is not reachable
# from the guest over RDMA, and the guest shares the host's root filesystem, so a micro Ceph
# (scripts/micro-ceph.sh, memstore OSD) runs INSIDE the guest on its own 127.0.0.1, and a
# second gateway in the guest serves an RBD image from it over nvme-rdma (port E2E_RBD_PORT,
# default 4421, a wildcard 0.0.0.0 listener) while the first keeps serving the memory namespace.
#
# Steps: k1 micro Ceph start in the guest, k2 gateway with an RBD namespace on rdma, k3 fio
# crc32c verify (4K random + 128K sequential), k4 16 MiB of random data written by the guest
# equal byte for byte in `rbd export`, k5 SIGTERM of that gateway, Ceph stopped.

RBD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
RBD_PORT=${E2E_RBD_PORT:-4421}
RBD_NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-rdma-rbd
RBD_IMG=rdma-a
RBD_DIR=/tmp/e2e-rdma-ceph
RBD_CONF=$WORK/gateway-rbd.toml
RBD_LOG=$WORK/gateway-rbd.log
RBD_GWPID=""
RBD_DEV=""

rbd_ceph_start() {
  local envl
  envl=$(MICRO_CEPH_NO_INSTALL=1 MICRO_CEPH_VERBOSE=1 MICRO_CEPH_MEMSTORE_SIZE=$((768 << 20)) \
    timeout -k 10 400 "$RBD_ROOT/scripts/micro-ceph.sh" start --dir "$RBD_DIR" --store memstore --no-mgr \
    --image "$RBD_IMG" --size 128M 2> "$WORK/micro-ceph.log" 3>&-) ||
    { say "micro-ceph.sh start failed:"; tail -n 8 "$WORK/micro-ceph.log" | sed 's/^/    | /'; return 1; }
  eval "$envl"
  grep -E '^\+|took|ready' "$WORK/micro-ceph.log" | tail -n 4 | sed 's/^/    | /'
  say "ceph in the guest: $(timeout 30 ceph -s --format json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["health"]["status"], d["osdmap"]["num_up_osds"], "OSD up")' 2>/dev/null)"
  timeout 60 rbd info "rbd/$RBD_IMG" | head -n 3 | sed 's/^/    /'
}
rbd_gateway_start() {
  cat > "$RBD_CONF" <<EOC
[gateway]
name = "e2e-rdma-rbd"

[[listener]]
transport = "rdma"
address = "0.0.0.0"
port = $RBD_PORT

[[subsystem]]
nqn = "$RBD_NQN"
allow_any_host = false
hosts = ["$HOSTNQN"]

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
pool = "rbd"
image = "$RBD_IMG"

[ceph]
conf = "$CEPH_CONF"
keyring = "$CEPH_KEYRING"
EOC
  cp "$RBD_CONF" "$LOGDIR/" 2>/dev/null
  "$GW" --config "$RBD_CONF" >> "$RBD_LOG" 2>&1 < /dev/null &
  RBD_GWPID=$!
  local i
  for i in $(seq 300); do
    grep -q 'NVMe/RDMA listener ready' "$RBD_LOG" && { say "gateway pid $RBD_GWPID serves rbd/$RBD_IMG on rdma 0.0.0.0:$RBD_PORT (wildcard: its device is set up at the first connect)"; return 0; }
    kill -0 $RBD_GWPID 2>/dev/null || { say "gateway exited"; tail -n 5 "$RBD_LOG" | sed 's/^/    | /'; RBD_GWPID=""; return 1; }
    sleep 0.1
  done
  say "no listener after 30 s"; return 1
}
rbd_connect() {
  timeout -k 5 90 nvme connect -t rdma -a $ADDR -s "$RBD_PORT" -n $RBD_NQN --hostnqn=$HOSTNQN --hostid=$HOSTID \
    --ctrl-loss-tmo=5 --reconnect-delay=1 > $WORK/err 2>&1 || { say "connect failed: $(cat $WORK/err)"; return 1; }
  RBD_DEV=$(NQN=$RBD_NQN ns_dev) || { RBD_DEV=""; say "no block device for $RBD_NQN"; return 1; }
  say "$RBD_DEV: $(( $(cat /sys/block/${RBD_DEV#/dev/}/size) * 512 )) bytes over rdma"
}
rbd_fio() {
  rbd_connect || return 1
  local save=$DEV rc=0
  DEV=$RBD_DEV
  fio_run rbd-randwrite-4k --rw=randwrite --bs=4k --size=16M --iodepth=16 || rc=1
  fio_run rbd-seqwrite-128k --rw=write --bs=128k --size=16M --offset=32M --iodepth=8 || rc=1
  DEV=$save
  return $rc
}
rbd_export_compare() {
  [ -n "$RBD_DEV" ] || { say "not connected"; return 1; }
  local blob=$WORK/rbd-blob exp=$WORK/rbd-export
  head -c 16M /dev/urandom > $blob
  dd if=$blob of="$RBD_DEV" bs=1M seek=64 oflag=direct status=none || { say "dd failed"; return 1; }
  cmp <(dd if="$RBD_DEV" bs=1M skip=64 count=16 iflag=direct status=none) $blob || { say "read back over rdma differs"; return 1; }
  disconnect_nqn $RBD_NQN > /dev/null || return 1
  RBD_DEV=""
  timeout -k 5 120 rbd export "rbd/$RBD_IMG" $exp > /dev/null 2>&1 || { say "rbd export failed"; return 1; }
  if cmp <(dd if=$exp bs=1M skip=64 count=16 status=none) $blob; then
    say "16 MiB at 64 MiB: equal in rbd export ($(sha256sum < $blob | cut -c1-16)...)"
  else
    say "rbd export differs from what the guest wrote"; return 1
  fi
  rm -f $exp
}
rbd_stop() {
  local rc=0
  [ -n "$RBD_DEV" ] && disconnect_nqn $RBD_NQN > /dev/null
  if [ -n "$RBD_GWPID" ]; then
    kill -TERM $RBD_GWPID
    for _ in $(seq 100); do kill -0 $RBD_GWPID 2>/dev/null || break; sleep 0.1; done
    if kill -0 $RBD_GWPID 2>/dev/null; then kill -KILL $RBD_GWPID; say "SIGKILL after 10 s"; rc=1; fi
    wait $RBD_GWPID; local st=$?
    say "rbd gateway exit status $st; $(grep 'queue pair closed' "$RBD_LOG" | tail -n 1 | grep -o 'live_qps=[0-9]*\| on_loan=[0-9]*' | tr '\n' ' ')"
    [ $st -eq 0 ] || rc=1
    RBD_GWPID=""
  fi
  cp "$RBD_LOG" "$LOGDIR/" 2>/dev/null
  MICRO_CEPH_NO_INSTALL=1 "$RBD_ROOT/scripts/micro-ceph.sh" stop "$RBD_DIR" > /dev/null 2>&1
  return $rc
}
rbd_cleanup() {
  [ -n "$RBD_GWPID" ] && kill -KILL $RBD_GWPID 2>/dev/null
  [ -d "$RBD_DIR" ] && MICRO_CEPH_NO_INSTALL=1 "$RBD_ROOT/scripts/micro-ceph.sh" stop "$RBD_DIR" > /dev/null 2>&1
  [ -s "$RBD_LOG" ] && cp "$RBD_LOG" "$LOGDIR/" 2>/dev/null
}
rbd_steps() {
  if step k1.rbd-ceph "micro Ceph (memstore) on the guest's 127.0.0.1" rbd_ceph_start &&
     step k2.rbd-gateway "a gateway in the guest serving rbd/$RBD_IMG on rdma 0.0.0.0:$RBD_PORT (wildcard listener)" rbd_gateway_start; then
    step k3.rbd-fio "nvme connect -t rdma to the RBD namespace, fio crc32c verify 4K random + 128K sequential" rbd_fio
    step k4.rbd-export "16 MiB written over rdma equal byte for byte in rbd export" rbd_export_compare
    step k5.rbd-stop "SIGTERM: the RBD gateway exits 0; Ceph stopped" rbd_stop
  else
    skip k3.rbd-fio "no Ceph or gateway"; skip k4.rbd-export "no Ceph or gateway"
    rbd_stop > /dev/null; skip k5.rbd-stop "no Ceph or gateway"
  fi
}
