#!/usr/bin/env bash
# demo.sh - start the whole thing on this machine: a micro Ceph cluster on 127.0.0.1, an RBD
# image, and the gateway serving it over NVMe/TCP on 127.0.0.1:4420.
#
#   scripts/demo.sh            start (installs missing Debian packages when run as root,
#                              builds the gateway in release mode)
#   scripts/demo.sh stop       stop the gateway and the cluster, remove their state
#   scripts/demo.sh status     is it running?
#
# Env: DEMO_DIR (default /tmp/nvmeof-demo), DEMO_PORT (4420), DEMO_IMAGE_SIZE (1G),
#      DEMO_BACKEND=memory to skip Ceph and serve a 1 GiB in-memory namespace instead.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${DEMO_DIR:-/tmp/nvmeof-demo}
PORT=${DEMO_PORT:-4420}
SIZE=${DEMO_IMAGE_SIZE:-1G}
BACKEND=${DEMO_BACKEND:-rbd}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:demo
CEPH_DIR=$DIR/ceph
GW=$ROOT/target/release/nvmeof-gateway
export PATH="$HOME/.cargo/bin:$PATH:/usr/local/sbin:/usr/sbin:/sbin"

say() { printf 'demo: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

gateway_pid() { [ -f "$DIR/gateway.pid" ] && cat "$DIR/gateway.pid"; }
gateway_running() { local p; p=$(gateway_pid) && kill -0 "$p" 2>/dev/null; }

stop() {
    if gateway_running; then
        local p; p=$(gateway_pid)
        kill -TERM "$p"
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$p" 2>/dev/null && kill -KILL "$p"
        say "gateway stopped"
    fi
    rm -f "$DIR/gateway.pid"
    if [ -d "$CEPH_DIR" ]; then
        "$ROOT/scripts/micro-ceph.sh" stop "$CEPH_DIR" >/dev/null && say "micro Ceph stopped"
    fi
    rm -rf "$DIR"
}

status() {
    if gateway_running; then
        say "gateway running (pid $(gateway_pid)), log $DIR/gateway.log"
    else
        say "gateway not running"; return 1
    fi
    if [ "$BACKEND" = rbd ]; then "$ROOT/scripts/micro-ceph.sh" status "$CEPH_DIR" >/dev/null && say "micro Ceph running"; fi
}

build() {
    command -v cargo >/dev/null || die "cargo not found: install the Rust toolchain (https://rustup.rs), then run this again"
    if [ "$(id -u)" = 0 ] && ! dpkg-query -W -f='${Status}' pkg-config 2>/dev/null | grep -q 'ok installed'; then
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq pkg-config >/dev/null
    fi
    say "building the gateway (release)"
    (cd "$ROOT" && cargo build --release -q -p nvmeof-gateway)
}

write_config() {
    {
        cat <<EOF2
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
EOF2
        if [ "$BACKEND" = rbd ]; then
            cat <<EOF2
backend = "rbd"
pool = "$MICRO_CEPH_POOL"
image = "$MICRO_CEPH_IMAGE"

[ceph]
conf = "$CEPH_CONF"
keyring = "$CEPH_KEYRING"
EOF2
        else
            printf 'backend = "memory"\nsize = "1GiB"\n'
        fi
    } > "$DIR/gateway.toml"
}

start() {
    if gateway_running; then
        say "already running (pid $(gateway_pid)); 'scripts/demo.sh stop' first to restart"
        exit 0
    fi
    mkdir -p "$DIR"
    build
    if [ "$BACKEND" = rbd ]; then
        say "starting micro Ceph in $CEPH_DIR"
        eval "$("$ROOT/scripts/micro-ceph.sh" start --dir "$CEPH_DIR" --image demo --size "$SIZE")"
    fi
    write_config
    "$GW" --config "$DIR/gateway.toml" --check >/dev/null
    say "starting the gateway: $GW --config $DIR/gateway.toml"
    RUST_LOG=${RUST_LOG:-info} NO_COLOR=1 setsid "$GW" --config "$DIR/gateway.toml" \
        >"$DIR/gateway.log" 2>&1 </dev/null &
    echo $! > "$DIR/gateway.pid"
    for _ in $(seq 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then break; fi
        gateway_running || { tail -n 20 "$DIR/gateway.log" >&2; die "the gateway exited"; }
        sleep 0.1
    done
    gateway_running || die "the gateway exited (log: $DIR/gateway.log)"
    cat <<EOF2

The gateway serves $( [ "$BACKEND" = rbd ] && echo "RBD image $MICRO_CEPH_POOL/$MICRO_CEPH_IMAGE ($SIZE)" || echo "a 1 GiB in-memory namespace") as
subsystem $NQN on 127.0.0.1:$PORT (NVMe/TCP).

From a Linux host with nvme-cli and the nvme-tcp module (this machine's own kernel, or the
test VM: tests/vm/run-in-vm.sh), where 127.0.0.1 reaches this machine:
    nvme discover -t tcp -a 127.0.0.1 -s $PORT
    nvme connect  -t tcp -a 127.0.0.1 -s $PORT -n $NQN
    nvme list
    nvme disconnect -n $NQN

Gateway log: $DIR/gateway.log    config: $DIR/gateway.toml
$( [ "$BACKEND" = rbd ] && echo "Ceph:        CEPH_CONF=$CEPH_CONF rbd ls $MICRO_CEPH_POOL")
Stop everything: scripts/demo.sh stop
EOF2
}

case ${1:-start} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' ;;
    *) die "unknown command $1 (start, stop, status)" ;;
esac
