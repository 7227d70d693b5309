#!/usr/bin/env bash
# demo.sh - start the whole thing on this machine: a micro Ceph cluster on 127.0.0.1, an RBD
# image, the control plane (nvmeof-control, state in RADOS) and a group of two gateways
# serving the image over NVMe/TCP on 127.0.0.1:4420 and :4421 (ANA multipath: one optimized
# path, the other inaccessible; kill the optimized gateway and the other takes over).
#
#   scripts/demo.sh            start (installs missing Debian packages when run as root,
#                              builds the gateway and the control plane in release mode)
#   scripts/demo.sh stop       stop the gateways, the control plane and the cluster, remove their state
#   scripts/demo.sh status     is it running?
#
# Env: DEMO_DIR (default /tmp/nvmeof-demo), DEMO_PORT (4420; the second gateway uses +1),
#      DEMO_CONTROL_PORT (5500), DEMO_IMAGE_SIZE (1G),
#      DEMO_BACKEND=memory to skip Ceph and the group: one gateway serving a 1 GiB in-memory
#      namespace.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${DEMO_DIR:-/tmp/nvmeof-demo}
PORT=${DEMO_PORT:-4420}
CONTROL_PORT=${DEMO_CONTROL_PORT:-5500}
SIZE=${DEMO_IMAGE_SIZE:-1G}
BACKEND=${DEMO_BACKEND:-rbd}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:demo
CEPH_DIR=$DIR/ceph
BIN=$ROOT/target/release
GW=$BIN/nvmeof-gateway
export PATH="$HOME/.cargo/bin:$PATH:/usr/local/sbin:/usr/sbin:/sbin"

say() { printf 'demo: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# Processes are recorded as NAME.pid in $DIR: control, gw1, gw2 (or gateway in memory mode).
pid_of() { [ -f "$DIR/$1.pid" ] && cat "$DIR/$1.pid"; }
running() { local p; p=$(pid_of "$1") && kill -0 "$p" 2>/dev/null; }
any_running() { local n; for n in gw1 gw2 gateway control; do running "$n" && return 0; done; return 1; }

stop_one() { # NAME
    if running "$1"; then
        local p; p=$(pid_of "$1")
        kill -TERM "$p"
        for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$p" 2>/dev/null && kill -KILL "$p"
        say "$1 stopped"
    fi
    rm -f "$DIR/$1.pid"
}

stop() {
    # Gateways first (a SIGTERM'd gateway hands its groups over through the control plane).
    stop_one gw2; stop_one gw1; stop_one gateway; stop_one control
    if [ -d "$CEPH_DIR" ]; then
        "$ROOT/scripts/micro-ceph.sh" stop "$CEPH_DIR" >/dev/null && say "micro Ceph stopped"
    fi
    rm -rf "$DIR"
}

status() {
    local n rc=1
    for n in control gw1 gw2 gateway; do
        running "$n" && { say "$n running (pid $(pid_of "$n")), log $DIR/$n.log"; rc=0; }
    done
    [ $rc = 0 ] || { say "not running"; return 1; }
    if [ "$BACKEND" = rbd ]; then
        "$ROOT/scripts/micro-ceph.sh" status "$CEPH_DIR" >/dev/null && say "micro Ceph running"
        ctl ana show || true
    fi
}

build() {
    command -v cargo >/dev/null || die "cargo not found: install the Rust toolchain (https://rustup.rs), then run this again"
    if [ "$(id -u)" = 0 ] && ! dpkg-query -W -f='${Status}' pkg-config 2>/dev/null | grep -q 'ok installed'; then
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq pkg-config >/dev/null
    fi
    say "building the gateway and the control plane (release)"
    (cd "$ROOT" && cargo build --release -q -p nvmeof-gateway -p control-plane)
}

ctl() { timeout -k 5 30 "$BIN/nvmeofctl" --server "127.0.0.1:$CONTROL_PORT" "$@"; }

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# spawn NAME LOG_PORT CMD...: start in the background, wait until it listens on the port
spawn() {
    local name=$1 port=$2; shift 2
    RUST_LOG=${RUST_LOG:-info} NO_COLOR=1 setsid "$@" >"$DIR/$name.log" 2>&1 </dev/null &
    echo $! > "$DIR/$name.pid"
    for _ in $(seq 300); do
        listening "$port" && return 0
        running "$name" || { tail -n 20 "$DIR/$name.log" >&2; die "$name exited (log: $DIR/$name.log)"; }
        sleep 0.1
    done
    die "$name not listening on 127.0.0.1:$port after 30 s (log: $DIR/$name.log)"
}

write_memory_config() {
    cat > "$DIR/gateway.toml" <<EOF2
# Written by scripts/demo.sh
[gateway]
name = "demo"

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = $PORT

[[subsystem]]
nqn = "$NQN"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1GiB"
EOF2
}

# Gateway N of the group: its name, controller ID range, listener, [group] and [ceph] only;
# subsystems and namespaces come from the control plane.
write_group_config() { # N
    local n=$1
    cat > "$DIR/gw$n.toml" <<EOF2
# Written by scripts/demo.sh
[gateway]
name = "gw$n"
cntlid_min = $(( (n - 1) * 2040 + 1 ))
cntlid_max = $(( n * 2040 ))

[group]
control_plane = ["127.0.0.1:$CONTROL_PORT"]
ana_group = $n

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = $(( PORT + n - 1 ))

[ceph]
conf = "$CEPH_CONF"
keyring = "$CEPH_KEYRING"
EOF2
}

start_memory() {
    write_memory_config
    "$GW" --config "$DIR/gateway.toml" --check >/dev/null
    say "starting the gateway: $GW --config $DIR/gateway.toml"
    spawn gateway "$PORT" "$GW" --config "$DIR/gateway.toml"
    cat <<EOF2

The gateway serves a 1 GiB in-memory namespace as subsystem $NQN
on 127.0.0.1:$PORT (NVMe/TCP).

From a Linux host with nvme-cli and the nvme-tcp module (this machine's own kernel, or the
test VM: tests/vm/run-in-vm.sh), where 127.0.0.1 reaches this machine:
    nvme discover -t tcp -a 127.0.0.1 -s $PORT
    nvme connect  -t tcp -a 127.0.0.1 -s $PORT -n $NQN
    nvme list
    nvme disconnect -n $NQN

Gateway log: $DIR/gateway.log    config: $DIR/gateway.toml
Stop everything: scripts/demo.sh stop
EOF2
}

start_group() {
    say "starting micro Ceph in $CEPH_DIR"
    eval "$("$ROOT/scripts/micro-ceph.sh" start --dir "$CEPH_DIR" --image demo --size "$SIZE")"
    say "starting the control plane on 127.0.0.1:$CONTROL_PORT (state: RADOS object nvmeof.demo.state in pool $MICRO_CEPH_POOL)"
    spawn control "$CONTROL_PORT" "$BIN/nvmeof-control" --listen "127.0.0.1:$CONTROL_PORT" --id control1 \
        --group demo --pool "$MICRO_CEPH_POOL" --ceph-conf "$CEPH_CONF" --keyring "$CEPH_KEYRING"
    local n joined
    for n in 1 2; do
        write_group_config "$n"
        "$GW" --config "$DIR/gw$n.toml" --check >/dev/null
        say "starting gateway gw$n on 127.0.0.1:$(( PORT + n - 1 )) (ANA group $n)"
        spawn "gw$n" $(( PORT + n - 1 )) "$GW" --config "$DIR/gw$n.toml"
    done
    # The namespace goes to gw1's ANA group, which exists once gw1 has joined.
    for _ in $(seq 150); do
        joined=$(ctl -o json gateway list 2>/dev/null | grep -c '"name"' || true)
        [ "${joined:-0}" -ge 2 ] && break
        sleep 0.2
    done
    [ "${joined:-0}" -ge 2 ] || die "the gateways did not join the control plane (logs: $DIR/gw1.log, $DIR/control.log)"
    ctl subsystem add --nqn "$NQN" --allow-any-host >/dev/null
    ctl listener add -n "$NQN" -g gw1 -a 127.0.0.1 -p "$PORT" >/dev/null
    ctl listener add -n "$NQN" -g gw2 -a 127.0.0.1 -p $(( PORT + 1 )) >/dev/null
    ctl namespace add -n "$NQN" --pool "$MICRO_CEPH_POOL" --image "$MICRO_CEPH_IMAGE" --nsid 1 --ana-group 1 >/dev/null
    # Served once gw1 reports group 1 optimized.
    for _ in $(seq 150); do
        ctl -o json ana show 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
ok = any(s.get("gateway") == "gw1" and s.get("ana_group") == 1 and s.get("state") in (1, "optimized")
         for s in d.get("states", []))
sys.exit(0 if ok else 1)' 2>/dev/null && break
        sleep 0.2
    done
    ctl ana show | sed 's/^/    /' >&2 || true
    cat <<EOF2

Two gateways serve RBD image $MICRO_CEPH_POOL/$MICRO_CEPH_IMAGE ($SIZE) as namespace 1 of subsystem
$NQN: gw1 on 127.0.0.1:$PORT (ANA optimized), gw2 on 127.0.0.1:$(( PORT + 1 ))
(inaccessible until gw1 goes away). The control plane (127.0.0.1:$CONTROL_PORT) keeps the
configuration in RADOS.

From a Linux host with nvme-cli and the nvme-tcp module (this machine's own kernel, or the
test VM: tests/vm/run-in-vm.sh), where 127.0.0.1 reaches this machine:
    nvme discover -t tcp -a 127.0.0.1 -s $PORT
    nvme connect-all -t tcp -a 127.0.0.1 -s $PORT     # both paths (native multipath)
    nvme list-subsys
    nvme disconnect -n $NQN

Manage it: $BIN/nvmeofctl --server 127.0.0.1:$CONTROL_PORT ana show | namespace list | gateway list | ...
Fail over:  kill -9 \$(cat $DIR/gw1.pid)   (gw2 becomes optimized after the fence)
Logs:       $DIR/{control,gw1,gw2}.log
Ceph:       CEPH_CONF=$CEPH_CONF rbd ls $MICRO_CEPH_POOL
Stop everything: scripts/demo.sh stop
EOF2
}

start() {
    if any_running; then
        say "already running; 'scripts/demo.sh stop' first to restart"
        exit 0
    fi
    mkdir -p "$DIR"
    build
    if [ "$BACKEND" = rbd ]; then start_group; else start_memory; fi
}

case ${1:-start} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' ;;
    *) die "unknown command $1 (start, stop, status)" ;;
esac
