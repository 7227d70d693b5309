#!/bin/bash
# e2e-group.sh - end-to-end test of the gateway group with the real Linux initiator using
# native NVMe multipath (ANA). Runs on the HOST (not in the VM):
#
#   tests/vm/e2e-group.sh [BIN_DIR]      (default: target/release; needs nvmeof-gateway,
#                                         nvmeof-control and nvmeofctl there)
#
# On the host, all on 127.0.0.1: a micro Ceph (memstore), two nvmeof-control replicas (state
# in RADOS, one leads), E2E_GATEWAYS (default 3) gateways gwN owning ANA group N and as many
# RBD images, all configured through nvmeofctl (subsystem, allowed host, listeners per
# gateway, nsid N = rbd/e2e-gN in ANA group N). The gateways' files hold
# only their name, controller ID range, listener, [group] and [ceph]: everything else is
# pushed. Then the VM (tests/vm/run-in-vm.sh) runs tests/vm/e2e-group-guest.sh, which
# reaches the host's 127.0.0.1 as 10.0.2.2 and asks the host to act through request files
# in sig/ (NNN.req: one line from the fixed list below; answered by NNN.done, first line
# "ok" or "fail", then details):
#   kill-gw N              kill -9 gateway N
#   start-gw N             start gateway N again (same file, same port), answer once it listens
#   fence-cycle N NSID LBA a fenced gateway that comes back without restarting: a small
#                          NVMe/TCP host (python) connects to gateway N and writes one block
#                          of 0xA5 at LBA of NSID (must succeed: N is optimized for it); the
#                          gateway is frozen (SIGSTOP) until the control plane reports it
#                          fenced and past the grace, then thawed (SIGCONT); the same
#                          connection at once writes 0x5A there: that write must fail, and
#                          `rbd export` must still hold 0xA5 (data intact)
#   freeze-gw N / thaw-gw N  SIGSTOP / SIGCONT gateway N (a frozen process: its sockets stay
#                          open, so only missed beacons and the hosts' keep-alive notice it)
#   cut-gw N / restore-gw N  gateway N's link down / up (E2E_NETCUT=1: N is the last one)
#   partition-gw N / heal-gw N  gateway N cut from Ceph and the control plane only (a
#                          blackhole route in its namespace: packets dropped, nothing reset),
#                          the host still reaching it; heal answers fail unless gateway N
#                          logged a self-demotion (lease) since the partition
#   ceph-cut-gw N / ceph-heal-gw N  gateway N cut from Ceph only (its route to the replicas'
#                          forwarders stays): it still beacons; ceph-heal answers fail unless
#                          gateway N logged that it is cut off from Ceph since the cut
#   osd-cut-gw N / osd-heal-gw N  gateway N cut from the OSD only (the monitor and the
#                          replicas still reached); osd-heal answers fail unless gateway N
#                          logged OSDs that do not answer it since the cut
#   kill-leader            kill -9 the leading nvmeof-control replica (nvmeofctl says which);
#                          answer once the other leads, after restarting the killed one
#   check IMAGE {zero OFF LEN | cmp OFF FILE}...   rbd export IMAGE, compare ranges
#   restart-all            save the nvmeofctl lists, kill -9 both gateways and both replicas,
#                          start them again (the gateways' files have no subsystem: all
#                          configuration must come back from RADOS), compare the lists
# Host steps (timed, PASS/FAIL): cluster, images, control plane, configuration, gateways,
# steady ANA state (nvmeofctl ana show), the VM run (the guest's own steps counted from its
# summary), unexpected fences (the control-plane logs show only the fences the test caused).
# Last line: "N passed, N failed" over host and guest steps. Exit 0 only if none failed.
# Whatever happens, the VM, the gateways, the replicas and the cluster are stopped (by PID).
#
# Env: E2E_LOG_DIR (default target/vm-logs; logs and shared files in $E2E_LOG_DIR/e2e-group),
#      E2E_TIMEOUT (VM hard timeout, default 900 s), E2E_ROUNDS (kill -9 failover rounds,
#      default 5), E2E_GRACE_MS (control plane's beacon grace, default 1500),
#      E2E_GATEWAYS (number of gateways, default 3, at least 2), E2E_NETCUT=1 (the last
#      gateway in its own network namespace, for the guest's network-cut rounds; needs root),
#      RUST_LOG (gateways and replicas, default info), VM_* (see run-in-vm.sh).
#      E2E_GUEST (the guest script, default tests/vm/e2e-group-guest.sh; it is given
#      SHARED_DIR ROUNDS PORTS CTL_SERVERS, CTL_SERVERS being the replicas as the guest
#      reaches them, and nvmeofctl is at SHARED_DIR/bin/nvmeofctl), E2E_NAME (the shared
#      directory's and the summary's name, default e2e-group), E2E_GUEST_ENV (names of
#      variables passed into the guest): how tests/vm/e2e-tenants.sh
#      runs its own guest script on this group. Two more requests serve such scripts:
#   rbd-create IMAGE MIB   rbd create --size MIB M rbd/IMAGE (IMAGE: [A-Za-z0-9_.-]+)
#   rbd-rm IMAGE           rbd rm rbd/IMAGE (only an image made by rbd-create)
set -u
export LC_ALL=C
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

BIN_SRC=${1:-$ROOT/target/release}
case $BIN_SRC in /*) ;; *) BIN_SRC=$PWD/$BIN_SRC ;; esac
TIMEOUT=${E2E_TIMEOUT:-900}
ROUNDS=${E2E_ROUNDS:-5}
GRACE_MS=${E2E_GRACE_MS:-1500}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-group
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2e09000-0000-4000-8000-000000000001
POOL=rbd
NGW=${E2E_GATEWAYS:-3}
# E2E_NETCUT=1: the last gateway runs in its own network namespace, reached through
# forwarders (tests/vm/tcp-forward.py), so that the guest's "cut-gw" can take its link
# down: a partition from the control plane, Ceph and the host at once, no connection reset
NETCUT=${E2E_NETCUT:-0}
CUT=""; [ "$NETCUT" = 1 ] && CUT=$NGW
NAME=${E2E_NAME:-e2e-group}
GUEST=${E2E_GUEST:-$ROOT/tests/vm/e2e-group-guest.sh}
case $GUEST in /*) ;; *) GUEST=$ROOT/$GUEST ;; esac
IMAGES=(); for _i in $(seq "$NGW"); do IMAGES+=("e2e-g$_i"); done
export NO_COLOR=1
exec 3>&1  # the terminal, for progress lines printed while an answer is being written

# shellcheck disable=SC2034  # read by steps.sh
STEP_PREFIX=host:
. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"
shared_dir "$NAME"  # SH, shared with the guest

# ------------------------------------------------------------- cleanup --
WORK="" CEPHDIR="" VMPID=""
GWPID=() CPPID=() GWPORT=() CPPORT=()  # indexed by gateway / replica number (1..)
stop_pid() { # PID [SIGNAL]: signal, wait up to 15 s, then SIGKILL; reaps it
  local p=$1
  [ -n "$p" ] || return 0
  if kill -0 "$p" 2>/dev/null; then
    kill "-${2:-TERM}" "$p" 2>/dev/null
    kill -CONT "$p" 2>/dev/null  # a frozen process must be able to die
    for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
  fi
  wait "$p" 2>/dev/null
  return 0
}
cleanup() {
  local i
  stop_vm "$NAME"
  for i in "${!GWPID[@]}"; do stop_pid "${GWPID[$i]}"; done
  for i in "${!CPPID[@]}"; do stop_pid "${CPPID[$i]}"; done
  GWPID=() CPPID=()
  netcut_teardown
  wait 2>/dev/null
  if [ -n "$CEPHDIR" ]; then
    "$ROOT/scripts/micro-ceph.sh" stop "$CEPHDIR" >/dev/null 2>&1 ||
      echo "$NAME: micro-ceph.sh stop $CEPHDIR failed"
  fi
  [ -n "$WORK" ] && rm -rf "$WORK"
  rm -f "$SH"/*.bin 2>/dev/null; rm -rf "$SH/bin"
  VMPID="" CEPHDIR="" WORK=""
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------- network cut --
# gw$CUT lives in namespace $NS: a veth pair (root $VETH_H $NET_H, namespace $VETH_G $NET_G);
# $NET_C, a second address of the root namespace's lo, where the micro Ceph's monitor binds
# (MICRO_CEPH_IP); $NET_O, where its OSD binds (MICRO_CEPH_OSD_IP, so the OSD alone can be
# cut); and $NET_R, a fourth, where the forwarders to the replicas listen (so Ceph alone can
# be cut). Taking $VETH_H down cuts gw$CUT from all of them; every other process keeps
# reaching them on lo.
NS="" VETH_H="" VETH_G="" NET_H="" NET_G="" NET_C="" NET_O="" NET_R="" FWD_PIDS=()
netcut_setup() {
  local o=$(( $$ % 200 + 20 ))
  NS=egcut$$ VETH_H=egh$$ VETH_G=egg$$
  NET_C=10.251.$o.1 NET_R=10.251.$o.2 NET_O=10.251.$o.3 NET_H=10.251.$o.5 NET_G=10.251.$o.6
  # A run killed before its cleanup (SIGKILL skips the trap) leaves its namespace, veth pair
  # and lo addresses; one whose process is gone is removed (its veth pair goes with it), and
  # the lo addresses are replaced rather than added, so its subnet cannot collide with ours.
  local old
  for old in $(ip netns list 2>/dev/null | awk '$1 ~ /^egcut[0-9]+$/ {print $1}'); do
    kill -0 "${old#egcut}" 2>/dev/null || { ip netns del "$old" && say "removed namespace $old, left by a killed run"; }
  done
  ip netns add "$NS" && ip -n "$NS" link set lo up &&
    ip addr replace "$NET_C/32" dev lo && ip addr replace "$NET_R/32" dev lo &&
    ip addr replace "$NET_O/32" dev lo &&
    ip link add "$VETH_H" type veth peer name "$VETH_G" && ip link set "$VETH_G" netns "$NS" &&
    ip addr add "$NET_H/30" dev "$VETH_H" && ip link set "$VETH_H" up &&
    ip -n "$NS" addr add "$NET_G/30" dev "$VETH_G" && ip -n "$NS" link set "$VETH_G" up &&
    ip -n "$NS" route add "$NET_C/32" via "$NET_H" && ip -n "$NS" route add "$NET_R/32" via "$NET_H" &&
    ip -n "$NS" route add "$NET_O/32" via "$NET_H" || { say "could not make namespace $NS (needs root and iproute2)"; return 1; }
  # a TCP connect from the namespace to $NET_C (no ping on every machine)
  python3 -c 'import socket, subprocess, sys
l = socket.create_server((sys.argv[1], 0)); port = l.getsockname()[1]
sys.exit(subprocess.call(["ip", "netns", "exec", sys.argv[2], "python3", "-c",
    "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)", sys.argv[1], str(port)]))' \
    "$NET_C" "$NS" || { say "$NS cannot reach $NET_C"; return 1; }
  export MICRO_CEPH_IP=$NET_C MICRO_CEPH_OSD_IP=$NET_O
  echo "$CUT" > "$SH/netcut"  # tells the guest which gateway it can cut off
  say "namespace $NS for gw$CUT: $VETH_G $NET_G <-> $VETH_H $NET_H; Ceph on lo $NET_C, the replicas' forwarders on lo $NET_R"
}
netcut_teardown() {
  local p
  for p in "${FWD_PIDS[@]}"; do stop_pid "$p"; done
  FWD_PIDS=()
  [ -n "$NS" ] || return 0
  ip link del "$VETH_H" 2>/dev/null; ip addr del "$NET_C/32" dev lo 2>/dev/null; ip addr del "$NET_R/32" dev lo 2>/dev/null
  ip addr del "$NET_O/32" dev lo 2>/dev/null
  ip netns del "$NS" 2>/dev/null
  NS=""
}
forward() { # [netns] MAPPINGS...: tcp-forward.py in the background, once it listens
  local out=$WORK/fwd.$RANDOM pre=()
  if [ "$1" = netns ]; then pre=(ip netns exec "$NS"); shift; fi
  "${pre[@]}" python3 "$ROOT/tests/vm/tcp-forward.py" "$@" > "$out" 2>&1 < /dev/null 3>&- &
  FWD_PIDS+=($!)
  for _ in $(seq 100); do grep -q ready "$out" 2>/dev/null && return 0; sleep 0.1; done
  say "tcp-forward.py $* did not start: $(cat "$out")"; return 1
}
# the guest (and the fence check's host) reach gw$CUT at 127.0.0.1:port through the root
# namespace's forwarder and the namespace's own (gw$CUT listens on its namespace's
# 127.0.0.1); gw$CUT reaches the replicas at $NET_R through forwarders to 127.0.0.1
netcut_forwarders() {
  local p=${GWPORT[$CUT]}
  forward netns "$NET_G:$p=127.0.0.1:$p" &&
    forward "127.0.0.1:$p=$NET_G:$p" "$NET_R:${CPPORT[1]}=127.0.0.1:${CPPORT[1]}" "$NET_R:${CPPORT[2]}=127.0.0.1:${CPPORT[2]}" &&
    say "forwarders: 127.0.0.1:$p -> $NET_G:$p -> ($NS) 127.0.0.1:$p; $NET_R:{${CPPORT[1]},${CPPORT[2]}} -> 127.0.0.1"
}
listening() { # N: gwN's port listens (in its namespace for gw$CUT)
  if [ "$1" = "$CUT" ]; then ip netns exec "$NS" ss -Hltn "sport = :${GWPORT[$1]}" | grep -q .; return; fi
  ! port_free "${GWPORT[$1]}"
}

# ---------------------------------------------------------------- setup --
fresh_shared_dir "$NAME"
GROUP=$NAME-$$-$RANDOM

for i in 1 2; do CPPORT[$i]=$(free_port "${CPPORT[@]}"); done
for i in $(seq $NGW); do GWPORT[$i]=$(free_port "${CPPORT[@]}" "${GWPORT[@]}"); done
SERVERS=127.0.0.1:${CPPORT[1]},127.0.0.1:${CPPORT[2]}
ctl() { timeout -k 5 30 "$WORK/nvmeofctl" --server "$SERVERS" "$@"; }

create_images() {
  local i
  for i in "${IMAGES[@]}"; do timeout -k 5 60 rbd create --size 256M "$POOL/$i" || return 1; done
  say "rbd ls $POOL: $(timeout 60 rbd ls "$POOL" | tr '\n' ' ')"
}
# the leading replica, as the replicas say (each asked alone: a replica started after the
# leader took the lease may not know it and says "")
leader() {
  local i l
  for i in 1 2; do
    [ -n "${CPPID[$i]:-}" ] || continue
    l=$(timeout -k 5 10 "$WORK/nvmeofctl" --server "127.0.0.1:${CPPORT[$i]}" -o json gateway list 2>/dev/null |
      sed -n 's/^ *"leader": "\(.*\)".*/\1/p')
    [ -n "$l" ] && { echo "$l"; return 0; }
  done
}
start_cp() { # N
  local n=$1 log=$SH/control$1.log
  echo "---- start $(date -u +%T.%N | cut -c1-12)" >> "$log"
  RUST_LOG=${RUST_LOG:-info} "$WORK/nvmeof-control" --listen "127.0.0.1:${CPPORT[$n]}" --id "cp$n" \
    --group "$GROUP" --pool "$POOL" --ceph-conf "$CEPH_CONF" --keyring "$CEPH_KEYRING" \
    --grace-ms "$GRACE_MS" --failback-delay-ms 1000 --lease-ms 3000 >> "$log" 2>&1 < /dev/null 3>&- &
  CPPID[$n]=$!
  for _ in $(seq 300); do
    port_free "${CPPORT[$n]}" || return 0
    kill -0 "${CPPID[$n]}" 2>/dev/null || { say "nvmeof-control cp$n exited: $(tail -n 5 "$log")"; return 1; }
    sleep 0.1
  done
  say "cp$n not listening on ${CPPORT[$n]} after 30 s"; return 1
}
start_control() {
  start_cp 1 && start_cp 2 || return 1
  local l
  for _ in $(seq 100); do l=$(leader); [ -n "$l" ] && break; sleep 0.1; done
  say "replicas cp1 127.0.0.1:${CPPORT[1]} (pid ${CPPID[1]}), cp2 127.0.0.1:${CPPORT[2]} (pid ${CPPID[2]}); leader: ${l:-none}; group state object nvmeof.$GROUP.state"
  [ -n "$l" ]
}
configure() {
  local i
  ctl subsystem add --nqn "$NQN" || return 1
  ctl host add -n "$NQN" --host "$HOSTNQN" || return 1
  for i in $(seq $NGW); do ctl listener add -n "$NQN" -g "gw$i" -a 127.0.0.1 -p "${GWPORT[$i]}" || return 1; done
}
write_gw_config() { # N
  local n=$1 cp=127.0.0.1
  [ "$n" = "$CUT" ] && cp=$NET_R
  cat > "$SH/gw$n.toml" <<EOF
[gateway]
name = "gw$n"
cntlid_min = $(( (n - 1) * 2040 + 1 ))
cntlid_max = $(( n * 2040 ))

[group]
control_plane = ["$cp:${CPPORT[1]}", "$cp:${CPPORT[2]}"]
ana_group = $n
beacon_interval_ms = 250

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = ${GWPORT[$n]}

[ceph]
conf = "$CEPH_CONF"
keyring = "$CEPH_KEYRING"
EOF
}
start_gw() { # N: start, wait until it listens
  local n=$1 log=$SH/gw$1.log
  [ -f "$SH/gw$n.toml" ] || write_gw_config "$n"
  echo "---- start $(date -u +%T.%N | cut -c1-12)" >> "$log"
  local pre=()
  [ "$n" = "$CUT" ] && pre=(ip netns exec "$NS")  # (exec: the pid is the gateway's)
  RUST_LOG=${RUST_LOG:-info} "${pre[@]}" "$WORK/nvmeof-gateway" --config "$SH/gw$n.toml" >> "$log" 2>&1 < /dev/null 3>&- &
  GWPID[$n]=$!
  for _ in $(seq 300); do
    listening "$n" && return 0
    kill -0 "${GWPID[$n]}" 2>/dev/null || { say "gw$n exited: $(tail -n 5 "$log")"; return 1; }
    sleep 0.1
  done
  say "gw$n not listening on ${GWPORT[$n]} after 30 s"; return 1
}
start_gateways() {
  local i
  for i in $(seq $NGW); do
    write_gw_config "$i"
    "$WORK/nvmeof-gateway" --config "$SH/gw$i.toml" --check >/dev/null || { say "--check refused gw$i.toml"; return 1; }
    start_gw "$i" || return 1
    say "gw$i pid ${GWPID[$i]} on 127.0.0.1:${GWPORT[$i]}, ANA group $i, controller IDs $(( (i - 1) * 2040 + 1 ))-$(( i * 2040 ))"
  done
  # the namespaces go to the gateways' groups, which exist once the gateways joined
  for _ in $(seq 100); do
    [ "$(ctl -o json gateway list 2>/dev/null | grep -c '"name"')" -ge $NGW ] && break; sleep 0.1
  done
  for i in $(seq $NGW); do
    ctl namespace add -n "$NQN" --image "${IMAGES[$((i - 1))]}" --nsid "$i" --ana-group "$i" || return 1
  done
}
# every group optimized on its owner, per nvmeofctl ana show
group_steady() {
  local out t0; t0=$(now)
  for _ in $(seq 300); do
    out=$(ctl -o json ana show 2>/dev/null)
    echo "$out" | python3 -c '
import json, sys
d = json.load(sys.stdin); n = int(sys.argv[1])
ok = len(d["groups"]) == n and all(g["holder"] == g["owner"] == "gw%d" % g["ana_group"] and g["phase"] == "active" for g in d["groups"])
opt = [(s["gateway"], s["ana_group"]) for s in d["states"] if s["state"] == 1]
ok = ok and sorted(opt) == [("gw%d" % i, i) for i in range(1, n + 1)]
sys.exit(0 if ok else 1)' "$NGW" && { say "steady after $(since "$t0")s:"; ctl ana show | sed 's/^/    | /'; ctl namespace list | sed 's/^/    | /'; return 0; }
    sleep 0.1
  done
  say "not steady after 30 s:"; ctl ana show | sed 's/^/    | /'; return 1
}

# ------------------------------------------------- requests from the guest --
num() { [[ $1 =~ ^[0-9]+$ ]]; }
gw_ok() { [[ ${1:-} =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le $NGW ]; }
image_ok() { [[ " ${IMAGES[*]} ${MADE_IMAGES[*]} " == *" $1 "* ]]; }
MADE_IMAGES=()  # made by the guest's rbd-create requests
act_rbd_create() { # IMAGE MIB
  [[ ${1:-} =~ ^[A-Za-z0-9_.-]+$ ]] && num "${2:-}" && [ $# -eq 2 ] || { echo fail; echo "usage: rbd-create IMAGE MIB"; return; }
  if timeout -k 5 60 rbd create --size "${2}M" "$POOL/$1" > "$WORK/rbd.out" 2>&1; then
    MADE_IMAGES+=("$1"); echo ok; echo "rbd create --size ${2}M $POOL/$1"
  else echo fail; cat "$WORK/rbd.out"; fi
}
act_rbd_rm() { # IMAGE
  [[ " ${MADE_IMAGES[*]} " == *" ${1:-} "* ]] && [ $# -eq 1 ] || { echo fail; echo "rbd-rm: '${1:-}' was not made by rbd-create"; return; }
  if timeout -k 5 60 rbd rm "$POOL/$1" > "$WORK/rbd.out" 2>&1; then echo ok; echo "rbd rm $POOL/$1"
  else echo fail; cat "$WORK/rbd.out"; fi
}
FENCES_CAUSED=0  # fences the test provokes (each kill -9 / freeze of a gateway holding a group)
act_kill_gw() { # N
  local n=$1 p=${GWPID[$1]:-}
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null || { echo fail; echo "gw$n is not running"; return; }
  kill -KILL "$p"; wait "$p" 2>/dev/null
  FENCES_CAUSED=$((FENCES_CAUSED + 1))
  echo "---- kill -9 $(date -u +%T.%N | cut -c1-12)" >> "$SH/gw$n.log"
  echo "    host: gw$n (pid $p) killed with SIGKILL at $(date -u +%T.%N | cut -c1-12)" >&3
  GWPID[$n]=""
  echo ok; echo "gw$n pid $p killed (SIGKILL)"
}
act_start_gw() { # N
  local n=$1 t0; t0=$(now)
  [ -n "${GWPID[$n]:-}" ] && kill -0 "${GWPID[$n]}" 2>/dev/null && { echo fail; echo "gw$n is already running"; return; }
  if start_gw "$n" > "$WORK/start.out" 2>&1; then
    echo ok; echo "gw$n restarted (pid ${GWPID[$n]}), listening after $(since "$t0")s"
  else echo fail; cat "$WORK/start.out"; fi
}
act_signal_gw() { # N STOP|CONT
  local n=$1 p=${GWPID[$1]:-}
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null || { echo fail; echo "gw$n is not running"; return; }
  kill "-$2" "$p"
  [ "$2" = STOP ] && FENCES_CAUSED=$((FENCES_CAUSED + 1))
  echo "---- SIG$2 $(date -u +%T.%N | cut -c1-12)" >> "$SH/gw$n.log"
  echo ok; echo "gw$n (pid $p) SIG$2"
}
act_link_gw() { # N down|up: the network cut of gw$CUT (its namespace's link)
  local n=$1
  [ -n "$CUT" ] && [ "$n" = "$CUT" ] || { echo fail; echo "gw$n is not in a network namespace (E2E_NETCUT=1 puts gw$NGW there)"; return; }
  ip link set "$VETH_H" "$2" || { echo fail; echo "ip link set $VETH_H $2 failed"; return; }
  [ "$2" = down ] && FENCES_CAUSED=$((FENCES_CAUSED + 1))
  echo "---- link $2 $(date -u +%T.%N | cut -c1-12)" >> "$SH/gw$n.log"
  echo ok; echo "gw$n's link $VETH_H $2"
}
DEMOTED_LINE='this gateway gave up its ANA groups'
STALLED_LINE='this gateway is cut off from Ceph'
OSDS_LINE='do not answer this gateway'
LINES_BEFORE=0
# act_blackhole_gw N on|off WHAT LINE ADDRS...: gw$CUT's routes to ADDRS blackholed (on) or
# back (off), not its route to the host; back, gw$CUT's log must have LINE since (what the
# gateway says when it notices)
act_blackhole_gw() {
  local n=$1 how=$2 what=$3 line=$4 a d; shift 4
  [ -n "$CUT" ] && [ "$n" = "$CUT" ] || { echo fail; echo "gw$n is not in a network namespace (E2E_NETCUT=1 puts gw$NGW there)"; return; }
  if [ "$how" = on ]; then
    LINES_BEFORE=$(grep -c "$line" "$SH/gw$n.log")
    for a in "$@"; do
      ip -n "$NS" route replace blackhole "$a/32" || { echo fail; echo "blackhole route to $a in $NS failed"; return; }
    done
    FENCES_CAUSED=$((FENCES_CAUSED + 1))
    echo "---- $what $(date -u +%T.%N | cut -c1-12)" >> "$SH/gw$n.log"
    echo ok; echo "gw$n: $what ($* blackholed in $NS); the host still reaches it"
    return
  fi
  for a in "$@"; do
    ip -n "$NS" route replace "$a/32" via "$NET_H" || { echo fail; echo "route to $a in $NS not restored"; return; }
  done
  echo "---- heal $(date -u +%T.%N | cut -c1-12)" >> "$SH/gw$n.log"
  d=$(( $(grep -c "$line" "$SH/gw$n.log") - LINES_BEFORE ))
  if [ "$d" -ge 1 ]; then echo ok; else echo fail; fi
  echo "gw$n's routes to $* back; '$line' logged since the $what: $d time(s)"
}
# partition: gw$CUT cut from Ceph and the replicas; it must demote itself (lease)
act_partition_gw() { act_blackhole_gw "$1" "$2" partition "$DEMOTED_LINE" "$NET_C" "$NET_O" "$NET_R"; }
# Ceph cut: gw$CUT cut from Ceph only, still beaconing; it must report the cluster stalled
act_ceph_cut_gw() { act_blackhole_gw "$1" "$2" "cut from Ceph" "$STALLED_LINE" "$NET_C" "$NET_O"; }
# OSD cut: gw$CUT cut from the OSD only, the monitor and the replicas still answering it; it
# must name the OSD, which answers the leader
act_osd_cut_gw() { act_blackhole_gw "$1" "$2" "cut from the OSD" "$OSDS_LINE" "$NET_O"; }
gw_state() { # N: the control plane's availability of gwN
  ctl -o json gateway list 2>/dev/null | python3 -c '
import json, sys
for g in json.load(sys.stdin)["gateways"]:
    if g["name"] == sys.argv[1]: print(g.get("state", g.get("availability", "")))' "gw$1"
}
FW_PY=$WORK/fenced-write.py
act_fence_cycle() { # N NSID LBA [cut]: SIGSTOP (or with "cut", the network cut) until fenced
  local n=$1 nsid=$2 lba=$3 how=${4:-freeze} p=${GWPID[$1]:-} res=$WORK/fw.json trig=$WORK/fw.trigger t0 st fpid
  num "$nsid" && num "$lba" || { echo fail; echo "bad arguments"; return; }
  [ "$how" = freeze ] || { [ "$how" = cut ] && [ "$n" = "$CUT" ]; } || { echo fail; echo "fence-cycle: '$how' on gw$n"; return; }
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null || { echo fail; echo "gw$n is not running"; return; }
  rm -f "$res" "$res.ready" "$trig"
  python3 "$FW_PY" 127.0.0.1 "${GWPORT[$n]}" "$NQN" "$HOSTNQN" "$nsid" "$lba" "$trig" "$res" > "$WORK/fw.out" 2>&1 &
  fpid=$!
  for _ in $(seq 300); do [ -e "$res.ready" ] || [ -e "$res" ] && break; sleep 0.1; done
  [ -e "$res.ready" ] || { stop_pid "$fpid"; echo fail; echo "the python host did not connect: $(cat "$res" "$WORK/fw.out" 2>/dev/null)"; return; }
  t0=$(now)
  local stop=(kill -STOP "$p") cont=(kill -CONT "$p") what=SIGSTOP back=SIGCONT
  [ "$how" = cut ] && stop=(ip link set "$VETH_H" down) cont=(ip link set "$VETH_H" up) what="link down" back="link up"
  "${stop[@]}"
  FENCES_CAUSED=$((FENCES_CAUSED + 1))
  echo "---- $what $(date -u +%T.%N | cut -c1-12)" >> "$SH/gw$n.log"
  echo "    host: gw$n (pid $p) $what at $(date -u +%T.%N | cut -c1-12)" >&3
  for _ in $(seq 300); do st=$(gw_state "$n"); [ "$st" = fenced ] && break; sleep 0.1; done
  local tf; tf=$(since "$t0")
  sleep 2  # well past the grace: the group has moved
  "${cont[@]}"
  touch "$trig"
  echo "---- $back $(date -u +%T.%N | cut -c1-12)" >> "$SH/gw$n.log"
  echo "    host: gw$n $back after $(since "$t0")s; control plane said '$st' after ${tf}s" >&3
  for _ in $(seq 600); do [ -e "$res" ] && break; sleep 0.1; done
  stop_pid "$fpid"
  local r; r=$(cat "$res" 2>/dev/null)
  local ok=1 out=()
  out+=("python host on gw$n: $r")
  out+=("gw$n availability: '$st' ${tf}s after the $what (grace ${GRACE_MS} ms)")
  [ "$st" = fenced ] || { out+=("gw$n never reported fenced"); ok=0; }
  echo "$r" | grep -q '"control_ok": true' || { out+=("the control write before the freeze did not succeed"); ok=0; }
  echo "$r" | grep -q '"fenced_write_failed": true' || { out+=("THE FENCED GATEWAY WROTE (or the write got no answer)"); ok=0; }
  # data intact: the block still holds the control write's 0xA5
  head -c 512 /dev/zero | tr '\0' '\245' > "$SH/fence-a5.bin"
  local c; c=$(check_image "${IMAGES[$((nsid - 1))]}" cmp $((lba * 512)) fence-a5.bin)
  out+=("$(echo "$c" | tail -n +2 | tr '\n' ';')")
  [ "$(echo "$c" | head -n 1)" = ok ] || ok=0
  out+=("fenced gw$n's log: $(grep -c 'this gateway was fenced' "$SH/gw$n.log") 'this gateway was fenced' line(s)")
  [ $ok = 1 ] && echo ok || echo fail
  printf '%s\n' "${out[@]}"
}
act_kill_leader() {
  local l n t0 l2 other
  l=$(leader)
  case $l in cp1) n=1 other=2 ;; cp2) n=2 other=1 ;; *) echo fail; echo "no leader known ('$l')"; return ;; esac
  t0=$(now)
  kill -KILL "${CPPID[$n]}"; wait "${CPPID[$n]}" 2>/dev/null
  echo "---- kill -9 $(date -u +%T.%N | cut -c1-12)" >> "$SH/control$n.log"
  echo "    host: leading replica cp$n (pid ${CPPID[$n]}) killed with SIGKILL at $(date -u +%T.%N | cut -c1-12)" >&3
  CPPID[$n]=""
  for _ in $(seq 300); do l2=$(leader); [ "$l2" = "cp$other" ] && break; sleep 0.1; done
  local took; took=$(since "$t0")
  if [ "$l2" != "cp$other" ]; then echo fail; echo "cp$other did not take over within 30 s (leader '$l2')"; return; fi
  if ! start_cp "$n" > "$WORK/start.out" 2>&1; then echo fail; echo "cp$n did not restart: $(cat "$WORK/start.out")"; return; fi
  echo ok
  echo "cp$n (leader) killed; cp$other leads after ${took}s (lease 3 s); cp$n restarted (pid ${CPPID[$n]}), leader now $(leader)"
}
LISTS=(subsystem namespace listener host)
save_lists() { # DIR
  local l
  mkdir -p "$1"
  for l in "${LISTS[@]}"; do  # without the state version (the group map's writes bump it)
    ctl -o json "$l" list 2>&1 | python3 -c 'import json,sys; d=json.load(sys.stdin); d.pop("version",None); json.dump(d,sys.stdout,indent=1,sort_keys=True)' > "$1/$l.json" || return 1
  done
}
act_restart_all() {
  local i t0 before=$WORK/lists.before after=$WORK/lists.after out=() ok=1 l
  save_lists "$before" || { echo fail; echo "nvmeofctl lists failed before the restart"; return; }
  t0=$(now)
  for i in $(seq $NGW); do
    [ -n "${GWPID[$i]:-}" ] && { kill -KILL "${GWPID[$i]}"; wait "${GWPID[$i]}" 2>/dev/null; GWPID[$i]=""; echo "---- kill -9 (restart-all)" >> "$SH/gw$i.log"; }
  done
  for i in 1 2; do
    [ -n "${CPPID[$i]:-}" ] && { kill -KILL "${CPPID[$i]}"; wait "${CPPID[$i]}" 2>/dev/null; CPPID[$i]=""; echo "---- kill -9 (restart-all)" >> "$SH/control$i.log"; }
  done
  echo "    host: every gateway and replica killed (SIGKILL) at $(date -u +%T.%N | cut -c1-12)" >&3
  for i in 1 2; do start_cp "$i" > "$WORK/start.out" 2>&1 || { echo fail; cat "$WORK/start.out"; return; }; done
  for _ in $(seq 100); do [ -n "$(leader)" ] && break; sleep 0.1; done
  for i in $(seq $NGW); do start_gw "$i" > "$WORK/start.out" 2>&1 || { echo fail; cat "$WORK/start.out"; return; }; done
  out+=("all restarted after $(since "$t0")s; leader $(leader)")
  save_lists "$after" || { echo fail; echo "nvmeofctl lists failed after the restart"; return; }
  for l in "${LISTS[@]}"; do
    if cmp -s "$before/$l.json" "$after/$l.json"; then out+=("nvmeofctl $l list: identical ($(grep -c '"' "$after/$l.json") lines of JSON)")
    else out+=("nvmeofctl $l list DIFFERS: $(diff "$before/$l.json" "$after/$l.json" | head -n 6 | tr '\n' ' ')"); ok=0; fi
  done
  if group_steady > "$WORK/steady.out" 2>&1; then out+=("groups steady again $(since "$t0")s after the kill")
  else out+=("groups not steady: $(tr '\n' ' ' < "$WORK/steady.out")"); ok=0; fi
  [ $ok = 1 ] && echo ok || echo fail
  printf '%s\n' "${out[@]}"
}
handle() { # reads one request line, prints the answer
  local line; read -r line || true
  # shellcheck disable=SC2086  # the request is a list of words
  set -- $line
  local a=${1:-}; [ $# -gt 0 ] && shift
  case $a in
    kill-gw) gw_ok "${1:-}" && act_kill_gw "$1" || { echo fail; echo "bad request '$line'"; } ;;
    start-gw) gw_ok "${1:-}" && act_start_gw "$1" || { echo fail; echo "bad request '$line'"; } ;;
    fence-cycle) gw_ok "${1:-}" && { [ $# -eq 3 ] || [ $# -eq 4 ]; } && act_fence_cycle "$@" || { echo fail; echo "bad request '$line'"; } ;;
    cut-gw) gw_ok "${1:-}" && act_link_gw "$1" down || { echo fail; echo "bad request '$line'"; } ;;
    restore-gw) gw_ok "${1:-}" && act_link_gw "$1" up || { echo fail; echo "bad request '$line'"; } ;;
    partition-gw) gw_ok "${1:-}" && act_partition_gw "$1" on || { echo fail; echo "bad request '$line'"; } ;;
    heal-gw) gw_ok "${1:-}" && act_partition_gw "$1" off || { echo fail; echo "bad request '$line'"; } ;;
    ceph-cut-gw) gw_ok "${1:-}" && act_ceph_cut_gw "$1" on || { echo fail; echo "bad request '$line'"; } ;;
    ceph-heal-gw) gw_ok "${1:-}" && act_ceph_cut_gw "$1" off || { echo fail; echo "bad request '$line'"; } ;;
    osd-cut-gw) gw_ok "${1:-}" && act_osd_cut_gw "$1" on || { echo fail; echo "bad request '$line'"; } ;;
    osd-heal-gw) gw_ok "${1:-}" && act_osd_cut_gw "$1" off || { echo fail; echo "bad request '$line'"; } ;;
    freeze-gw) gw_ok "${1:-}" && act_signal_gw "$1" STOP || { echo fail; echo "bad request '$line'"; } ;;
    thaw-gw) gw_ok "${1:-}" && act_signal_gw "$1" CONT || { echo fail; echo "bad request '$line'"; } ;;
    kill-leader) act_kill_leader ;;
    check) check_image "$@" ;;
    restart-all) act_restart_all ;;
    rbd-create) act_rbd_create "$@" ;;
    rbd-rm) act_rbd_rm "$@" ;;
    *) echo fail; echo "unknown request '$line'" ;;
  esac
}
run_vm() {
  local ports="" i ctl_servers="10.0.2.2:${CPPORT[1]},10.0.2.2:${CPPORT[2]}"
  for i in $(seq $NGW); do ports+=${ports:+,}${GWPORT[$i]}; done  # gw1's port first
  mkdir -p "$SH/bin" && cp "$WORK/nvmeofctl" "$SH/bin/nvmeofctl" || return 1  # the guest's /tmp is its own
  say "tests/vm/run-in-vm.sh -t $TIMEOUT -w $SH ${GUEST#"$ROOT"/} $SH $ROUNDS $ports $ctl_servers"
  local envs=() v
  for v in ${E2E_GUEST_ENV:-}; do envs+=(-e "$v"); done
  run_guest -t "$TIMEOUT" -w "$SH" "${envs[@]}" "$GUEST" "$SH" "$ROUNDS" "$ports" "$ctl_servers"
}
fences_as_caused() { # every fence of a whole gateway was caused by the test
  local n
  n=$(cat "$SH"/control*.log 2>/dev/null | grep 'control_plane::server: fencing' | grep -c 'scope=Gateway')
  say "gateway fences in the control-plane logs: $n; gateway kills/freezes by the test: $FENCES_CAUSED, plus restart-all (up to $NGW)"
  cat "$SH"/control*.log | grep 'control_plane::server: fencing' | sed 's/^/    | /' | tail -n 20
  # (scope=Group fences without addresses are the failback's fence of the survivor's group)
  [ "$n" -le $((FENCES_CAUSED + NGW)) ]
}
stop_gateways() { # SIGTERM: a planned shutdown; every gateway must exit 0 within 15 s
  local i rc ok=0 p
  for i in $(seq $NGW -1 1); do
    p=${GWPID[$i]:-}
    [ -n "$p" ] && kill -0 "$p" 2>/dev/null || { say "gw$i not running"; ok=1; continue; }
    kill -TERM "$p"
    for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then say "gw$i still running 15 s after SIGTERM"; kill -KILL "$p"; ok=1; fi
    wait "$p"; rc=$?; GWPID[$i]=""
    say "gw$i exited with status $rc after SIGTERM: $(grep -E 'groups moved away|no group to move away|stopped' "$SH/gw$i.log" | tail -n 2 | sed 's/.*INFO //' | tr '\n' ';')"
    [ $rc -eq 0 ] || ok=1
  done
  return $ok
}

write_fenced_write_py() {
cat > "$FW_PY" <<'PY'
# A minimal NVMe/TCP host: an admin and an I/O queue on one gateway, 512-byte writes with
# in-capsule data. Layouts as in Linux include/linux/nvme-tcp.h and nvme.h (and this
# project's gateway/src/host/cmd.rs).
import json, os, socket, struct, sys, time
PDU_ICREQ, PDU_ICRESP, PDU_CMD, PDU_RSP, PDU_C2H_DATA = 0x00, 0x01, 0x04, 0x05, 0x07
HLEN_IC, HLEN_CMD = 128, 72
OPC_FABRICS, FCTYPE_PROP_SET, FCTYPE_CONNECT, FCTYPE_PROP_GET = 0x7F, 0x00, 0x01, 0x04
OPC_WRITE, OPC_READ = 0x01, 0x02
PSDT_SGL = 1 << 6
SGL_DATA_BLOCK_OFFSET = 0x01     # data block descriptor, offset subtype: in-capsule data
SGL_TRANSPORT_DATA_BLOCK = 0x5A  # transport data block: C2HData
REG_CC, REG_CSTS = 0x14, 0x1C
CC_EN, CC_IOSQES, CC_IOCQES = 1, 6 << 16, 4 << 20
CNTLID_DYNAMIC = 0xFFFF

class Closed(RuntimeError):
    pass

class Queue:
    def __init__(self, addr, port):
        self.s = socket.create_connection((addr, port), timeout=120)
        self.cid = 0
        ic = struct.pack('<BBBBIHBBI', PDU_ICREQ, 0, HLEN_IC, 0, HLEN_IC, 0, 0, 0, 0)
        self.s.sendall(ic.ljust(HLEN_IC, b'\0'))
        h = self.recv(8)
        if h[0] != PDU_ICRESP:
            raise RuntimeError('no ICResp (PDU type %d)' % h[0])
        self.recv(struct.unpack('<I', h[4:8])[0] - 8)
    def recv(self, n):
        b = b''
        while len(b) < n:
            c = self.s.recv(n - len(b))
            if not c:
                raise Closed('connection closed by the gateway')
            b += c
        return b
    def submit(self, sqe, data=b''):
        self.cid = (self.cid + 1) & 0xFFFF
        sqe = bytearray(sqe)
        sqe[2:4] = struct.pack('<H', self.cid)
        hdr = struct.pack('<BBBBI', PDU_CMD, 0, HLEN_CMD, HLEN_CMD if data else 0, HLEN_CMD + len(data))
        self.s.sendall(hdr + bytes(sqe) + data)
        payload = b''
        while True:
            h = self.recv(8)
            body = self.recv(struct.unpack('<I', h[4:8])[0] - 8)
            if h[0] == PDU_C2H_DATA:
                payload += body[h[3] - 8:]
                continue
            if h[0] != PDU_RSP:
                raise RuntimeError('unexpected PDU type %d' % h[0])
            return struct.unpack('<I', body[0:4])[0], struct.unpack('<H', body[14:16])[0] >> 1, payload

def sqe(opcode, nsid=0):
    b = bytearray(64)
    b[0], b[1] = opcode, PSDT_SGL
    b[4:8] = struct.pack('<I', nsid)
    return b

def fabrics(fctype):
    b = sqe(OPC_FABRICS)
    b[4] = fctype
    return b

def connect(q, subnqn, hostnqn, qid, cntlid, kato_ms):
    c = fabrics(FCTYPE_CONNECT)
    c[24:40] = struct.pack('<QI3xB', 0, 1024, SGL_DATA_BLOCK_OFFSET)
    c[42:44] = struct.pack('<H', qid)
    c[44:46] = struct.pack('<H', 15)
    c[48:52] = struct.pack('<I', kato_ms)
    d = bytearray(1024)
    d[0:16] = os.urandom(16)
    d[16:18] = struct.pack('<H', cntlid)
    d[256:256 + len(subnqn)] = subnqn.encode()
    d[512:512 + len(hostnqn)] = hostnqn.encode()
    dw0, st, _ = q.submit(c, bytes(d))
    if st:
        raise RuntimeError('Connect of queue %d refused: status 0x%x' % (qid, st))
    return dw0 & 0xFFFF

def prop(q, fctype, off, val=0):
    c = fabrics(fctype)
    c[44:48] = struct.pack('<I', off)
    c[48:56] = struct.pack('<Q', val)
    return q.submit(c)

def rw(q, opc, nsid, lba, data=b'', nbytes=0):
    c = sqe(opc, nsid)
    n = len(data) or nbytes
    c[24:40] = struct.pack('<QI3xB', 0, n, SGL_DATA_BLOCK_OFFSET if data else SGL_TRANSPORT_DATA_BLOCK)
    c[40:48] = struct.pack('<Q', lba)
    c[48:50] = struct.pack('<H', n // 512 - 1)
    _, st, payload = q.submit(c, data)
    return st, payload

def status_name(st):
    sct, sc = (st >> 8) & 7, st & 0xFF
    names = {(0, 0): 'success', (0, 6): 'internal error', (2, 0x80): 'write fault',
             (3, 1): 'ANA persistent loss', (3, 2): 'ANA inaccessible', (3, 3): 'ANA transition'}
    return 'SCT %d SC 0x%02x (%s)' % (sct, sc, names.get((sct, sc), 'see the spec'))

addr, port, subnqn, hostnqn = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
nsid, lba, trigger, result = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], sys.argv[8]
out = {}

def associate():
    # an admin queue connected and enabled, and I/O queue 1 of the same controller
    adm = Queue(addr, port)
    cntlid = connect(adm, subnqn, hostnqn, 0, CNTLID_DYNAMIC, 120000)
    prop(adm, FCTYPE_PROP_SET, REG_CC, CC_EN | CC_IOSQES | CC_IOCQES)
    for _ in range(100):
        if prop(adm, FCTYPE_PROP_GET, REG_CSTS)[0] & 1:
            break
        time.sleep(0.05)
    io = Queue(addr, port)
    connect(io, subnqn, hostnqn, 1, cntlid, 0)
    return adm, io

try:
    adm, io = associate()
    a = bytes([0xA5]) * 512
    st, _ = rw(io, OPC_WRITE, nsid, lba, a)
    out['control_write'] = status_name(st)
    out['control_ok'] = st == 0
    st, back = rw(io, OPC_READ, nsid, lba, nbytes=512)
    out['control_read_back_ok'] = st == 0 and back == a
    open(result + '.ready', 'w').write('ready\n')
    while not os.path.exists(trigger):  # frozen, fenced and thawed meanwhile
        time.sleep(0.01)
    t0 = time.monotonic()
    try:
        st, _ = rw(io, OPC_WRITE, nsid, lba, bytes([0x5A]) * 512)
    except (OSError, Closed) as e:
        # A gateway that demoted itself (lease) closes controllers with commands stuck at
        # the cluster: the write is tried again on a new association, as a host would.
        out['reconnected_after'] = str(e) or type(e).__name__
        adm, io = associate()
        st, _ = rw(io, OPC_WRITE, nsid, lba, bytes([0x5A]) * 512)
    out['fenced_write'] = status_name(st)
    out['fenced_write_failed'] = st != 0
    out['fenced_write_ms'] = round((time.monotonic() - t0) * 1000)
except Exception as e:
    out['error'] = str(e)
json.dump(out, open(result, 'w'))
PY
}

# ------------------------------------------------------------------ main --
echo "$NAME: binaries from $BIN_SRC, gateways gw1..gw$NGW on ports $(for i in $(seq $NGW); do printf '%s ' "${GWPORT[$i]}"; done), replicas cp1, cp2 on ${CPPORT[1]} ${CPPORT[2]}, shared dir $SH, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
write_fenced_write_py
if step binaries "private copies of nvmeof-gateway, nvmeof-control, nvmeofctl" copy_binaries "$WORK" &&
   { [ "$NETCUT" != 1 ] || step netns "gw$CUT's network namespace, its veth, and the address on lo Ceph binds" netcut_setup; } &&
   step cluster.start "micro Ceph (1 mon, 1 OSD, memstore) on ${MICRO_CEPH_IP:-127.0.0.1}" start_cluster &&
   step images "rbd create ${IMAGES[*]} (256 MiB each)" create_images &&
   step control.start "two nvmeof-control replicas (state in RADOS, lease 3 s, grace ${GRACE_MS} ms); one leads" start_control &&
   step configure "nvmeofctl: subsystem, allowed host, a listener per gateway" configure &&
   { [ "$NETCUT" != 1 ] || step forwarders "the forwarders to and from gw$CUT's namespace" netcut_forwarders; } &&
   step gateways.start "$NGW gateways (files without subsystems); nvmeofctl namespace add nsid N -> ANA group N" start_gateways &&
   step group.steady "nvmeofctl ana show: group N optimized on gwN only" group_steady; then
  step vm "the guest's steps (${GUEST#"$ROOT"/})" run_vm
  step fences "the control plane fenced only the gateways the test killed or froze" fences_as_caused
  step gateways.sigterm "SIGTERM (planned shutdown) of gw$NGW..gw1: each exits 0" stop_gateways
else
  skip vm "the group did not start"
fi
for i in 1 2; do [ -n "${CPPID[$i]:-}" ] && echo "nvmeof-control cp$i: $(grep -c 'leading the gateway group' "$SH/control$i.log") time(s) leader"; done
cleanup; trap - EXIT

pauses() { grep -E '^PAUSE ' "$VMOUT" 2>/dev/null; return 0; }
host_summary "$NAME summary" pauses
