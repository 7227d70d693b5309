#!/bin/bash
# e2e-tcp-ipv6-slirp.sh - the Linux initiator in the VM reaches a gateway on the HOST over
# IPv6 through QEMU's user network (slirp with ipv6=on: the host is fec0::2 to the guest;
# slirp turns the guest's connections to fec0::2 into connections to the host's ::1).
#
# usage (on the host): tests/vm/e2e-tcp-ipv6-slirp.sh <nvmeof-gateway binary>
#   Starts the gateway on the host listening on [::]:$E2E_SLIRP_PORT (default 14430), boots
#   the VM with VM_NET_OPTS=ipv4=on,ipv6=on (the last ipv6= given to -netdev wins over
#   run-in-vm.sh's ipv6=off; ipv4=on too: QEMU turns IPv4 off when only ipv6= is given)
#   and runs this script with --guest inside: fec0::15/64 on eth0,
#   nvme discover -a fec0::2 (the log's entry has adrfam ipv6), nvme connect -a fec0::2,
#   fio crc32c verify, disconnect. Then SIGTERM to the gateway (exit status 0).
# Last line: "N passed, N failed". Exit 0 only if nothing failed.
#
# The discovery log lists the [::] listener at ::1: the address the connection reached on
# the host, after slirp's translation (a real network has no such translation).
set -u
export LC_ALL=C
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PORT=${E2E_SLIRP_PORT:-14430}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-ipv6
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
HOSTID=11111111-2222-3333-4444-555555555555
HOST6=fec0::2
GUEST6=fec0::15

. "$HERE/steps.sh"

# ------------------------------------------------------------------ guest --
guest_net() {
  echo 0 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6 || return 1
  ip -6 addr add $GUEST6/64 dev eth0 nodad || return 1
  ip -6 addr show dev eth0 | sed 's/^/    /'
}
DEV=""
guest_discover() {
  local out rc
  out=$(timeout -k 5 60 nvme discover -t tcp -a $HOST6 -s "$PORT" --hostnqn=$HOSTNQN --hostid=$HOSTID 2>&1)
  rc=$?
  echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme discover -a $HOST6 failed (rc=$rc)"; return 1; }
  echo "$out" | grep -q "subnqn: *$NQN\$" || { say "$NQN not listed"; return 1; }
  echo "$out" | grep -q "adrfam: *ipv6\$" || { say "no adrfam ipv6 entry"; return 1; }
}
guest_connect() {
  local out rc c
  out=$(timeout -k 5 90 nvme connect -t tcp -a $HOST6 -s "$PORT" -n $NQN --hostnqn=$HOSTNQN --hostid=$HOSTID \
    --ctrl-loss-tmo=5 --reconnect-delay=1 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme connect -a $HOST6 failed (rc=$rc)"; return 1; }
  for _ in $(seq 150); do
    for c in /sys/class/nvme/nvme*; do
      [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
      say "controller ${c##*/}: $(cat "$c/address")"
      for n in "$c"/nvme*n*; do [ -b "/dev/${n##*/}" ] && DEV=/dev/${n##*/}; done
      [ -z "$DEV" ] && for n in /sys/class/nvme-subsystem/*/nvme*n*; do
        [ -b "/dev/${n##*/}" ] && [ "$(cat "${n%/*}/subsysnqn")" = "$NQN" ] && DEV=/dev/${n##*/}
      done
    done
    [ -n "$DEV" ] && { say "namespace $DEV"; return 0; }
    sleep 0.1
  done
  say "no namespace block device appeared"
  return 1
}
guest_fio() {
  (cd /tmp && timeout -k 10 300 fio --name=slirp6 --filename="$DEV" --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 \
    --rw=randwrite --bs=4k --size=4M --iodepth=8) > /tmp/fio-slirp6.log 2>&1
  local rc=$?
  grep -E 'IOPS|err=' /tmp/fio-slirp6.log | sed 's/^/    /'
  [ $rc -eq 0 ] && ! grep -qE 'err= *[1-9]' /tmp/fio-slirp6.log
}
guest_disconnect() { timeout -k 5 60 nvme disconnect -n $NQN 2>&1 | sed 's/^/    /'; return "${PIPESTATUS[0]}"; }

if [ "${1:-}" = --guest ]; then
  PORT=$2
  step setup.modprobe "load nvme-tcp" modprobe -a nvme-core nvme-tcp
  if step slirp6.net "IPv6 on eth0: $GUEST6/64 (host at $HOST6)" guest_net &&
     step slirp6.discover "nvme discover -a $HOST6 -s $PORT: $NQN listed, adrfam ipv6" guest_discover &&
     step slirp6.connect "nvme connect -a $HOST6 -s $PORT" guest_connect; then
    step slirp6.fio "fio 4K randwrite 4M, crc32c verify" guest_fio
    step slirp6.disconnect "nvme disconnect" guest_disconnect
  fi
  echo "$PASS passed, $FAIL failed"
  [ $FAIL -eq 0 ]
  exit
fi

# ------------------------------------------------------------------- host --
GW=${1:?usage: e2e-tcp-ipv6-slirp.sh <nvmeof-gateway binary>}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/e2e-slirp6.XXXXXX")
GWPID=""
cleanup() {
  [ -n "$GWPID" ] && kill -KILL "$GWPID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
cat > "$WORK/gateway.toml" <<EOF
[[listener]]
transport = "tcp"
address = "[::]:$PORT"

[[subsystem]]
nqn = "$NQN"
hosts = ["$HOSTNQN"]

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "64MiB"
EOF
NO_COLOR=1 "$GW" --config "$WORK/gateway.toml" > "$WORK/gateway.log" 2>&1 < /dev/null &
GWPID=$!
for _ in $(seq 100); do grep -q "listener ready" "$WORK/gateway.log" && break; sleep 0.1; done
grep -q "listener ready" "$WORK/gateway.log" || { cat "$WORK/gateway.log"; echo "0 passed, 1 failed"; exit 1; }
echo "host: gateway pid $GWPID on [::]:$PORT"
VM_NET_OPTS=ipv4=on,ipv6=on "$HERE/run-in-vm.sh" -t "${E2E_TIMEOUT:-300}" "$0" --guest "$PORT"
rc=$?
kill -TERM "$GWPID"
wait "$GWPID"; grc=$?
GWPID=""
echo "host: gateway exited with status $grc; its log:"
sed 's/^/    | /' "$WORK/gateway.log" | tail -n 15
[ $rc -eq 0 ] && [ $grc -eq 0 ]
