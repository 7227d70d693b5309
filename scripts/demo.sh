#!/usr/bin/env bash
# demo.sh - start the whole thing on this machine: a micro Ceph cluster on 127.0.0.1, an RBD
# image, the control plane (nvmeof-control, state in RADOS) and a group of two gateways
# serving the image over NVMe/TCP on 127.0.0.1:4420 and :4421 (ANA multipath: one optimized
# path, the other inaccessible; kill the optimized gateway and the other takes over).
#
#   scripts/demo.sh            start (installs missing Debian packages when run as root,
#                              builds the gateway and the control plane in release mode)
#   scripts/demo.sh stop       stop the gateways, the control plane and the cluster, remove their state
#   scripts/demo.sh status     is it running? Exit 0: every part runs; 1: some part is down;
#                              3: nothing runs
#
# Env: DEMO_DIR (default /tmp/nvmeof-demo), DEMO_PORT (4420; the second gateway uses +1),
#      DEMO_CONTROL_PORT (5500), DEMO_METRICS_PORT (10008: the gateways' Prometheus
#      /metrics; the second gateway's is +1, the control plane's +2), DEMO_IMAGE_SIZE (1G),
#      DEMO_BACKEND=memory to skip Ceph and the group: one gateway serving a 1 GiB in-memory
#      namespace,
#      DEMO_BIN: a directory holding nvmeof-gateway, nvmeof-control and nvmeofctl to run
#      instead of building target/release (tests run private copies of the binaries).
# A start that fails stops what it had started and keeps the logs in DEMO_DIR.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${DEMO_DIR:-/tmp/nvmeof-demo}
PORT=${DEMO_PORT:-4420}
CONTROL_PORT=${DEMO_CONTROL_PORT:-5500}
METRICS_PORT=${DEMO_METRICS_PORT:-10008}
SIZE=${DEMO_IMAGE_SIZE:-1G}
BACKEND=${DEMO_BACKEND:-rbd}
NQN=nqn.2016-06.io.ceph-nvmeof-rs:demo
CEPH_DIR=$DIR/ceph
BIN=${DEMO_BIN:-$ROOT/target/release}
GW=$BIN/nvmeof-gateway
export PATH="$HOME/.cargo/bin:$PATH:/usr/local/sbin:/usr/sbin:/sbin"

say() { printf 'demo: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# Processes are recorded as NAME.pid in $DIR: control, gw1, gw2 (or gateway in memory mode).
# The files hold the PID only (kill -9 $(cat gw1.pid) is the failover demo).
pid_of() { [ -f "$DIR/$1.pid" ] && cat "$DIR/$1.pid"; }
comm_of() { case $1 in control) echo nvmeof-control ;; *) echo nvmeof-gateway ;; esac; }
# running NAME: its recorded PID is alive, not a zombie (a killed daemon reparented to a slow
# reaper) and still runs our binary (not a recycled PID)
running() {
    local p stat
    p=$(pid_of "$1") || return 1
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$(comm_of "$1")" ] || return 1
    stat=$(cat "/proc/$p/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}
any_running() { local n; for n in gw1 gw2 gateway control; do running "$n" && return 0; done; return 1; }

stop_one() { # NAME: SIGTERM, SIGKILL after 10 s
    if running "$1"; then
        local p; p=$(pid_of "$1")
        kill -TERM "$p" 2>/dev/null || true
        for _ in $(seq 100); do running "$1" || break; sleep 0.1; done
        if running "$1"; then
            say "$1 (pid $p) still running 10 s after SIGTERM: SIGKILL"
            kill -KILL "$p" 2>/dev/null || true
            for _ in $(seq 50); do running "$1" || break; sleep 0.1; done
        fi
        running "$1" && die "$1 (pid $p) did not die; $DIR kept"
        say "$1 stopped"
    fi
    rm -f "$DIR/$1.pid"
}

# Every process of the demo, gateways first (a SIGTERM'd gateway hands its groups over
# through the control plane), then the control plane, then the cluster.
stop_processes() {
    stop_one gw2; stop_one gw1; stop_one gateway; stop_one control
    if [ -d "$CEPH_DIR" ]; then
        "$ROOT/scripts/micro-ceph.sh" stop "$CEPH_DIR" >/dev/null || die "micro-ceph.sh stop $CEPH_DIR failed"
        say "micro Ceph stopped"
    fi
}

is_demo_dir() { [ -f "$DIR/backend" ] || [ -f "$DIR/gw1.toml" ] || [ -f "$DIR/gateway.toml" ]; }

stop() {
    [ -d "$DIR" ] || { say "not running (no $DIR)"; return 0; }
    is_demo_dir || die "$DIR does not look like a demo directory (no backend file): left alone"
    stop_processes
    rm -rf "$DIR"
}

status() {
    local n names missing=0 up=0
    [ -d "$DIR" ] || { say "not running (no $DIR)"; return 3; }
    if [ "$BACKEND" = rbd ]; then names="control gw1 gw2"; else names=gateway; fi
    for n in $names; do
        if running "$n"; then say "$n running (pid $(pid_of "$n")), log $DIR/$n.log"; up=$((up + 1))
        else say "$n NOT running$([ -f "$DIR/$n.log" ] && echo ", log $DIR/$n.log")"; missing=$((missing + 1)); fi
    done
    if [ "$BACKEND" = rbd ]; then
        if "$ROOT/scripts/micro-ceph.sh" status "$CEPH_DIR" >/dev/null 2>&1; then
            say "micro Ceph running ($CEPH_DIR)"; up=$((up + 1))
        else say "micro Ceph NOT running ($CEPH_DIR)"; missing=$((missing + 1)); fi
        running control && { ctl ana show || true; }
    fi
    [ $up -gt 0 ] || { say "not running"; return 3; }
    [ $missing -eq 0 ] || return 1
}

build() {
    if [ -n "${DEMO_BIN:-}" ]; then
        local b
        for b in nvmeof-gateway nvmeof-control nvmeofctl; do
            [ -x "$BIN/$b" ] || die "DEMO_BIN=$BIN has no $b"
        done
        say "using the binaries in $BIN (DEMO_BIN: nothing built)"
        return 0
    fi
    command -v cargo >/dev/null || die "cargo not found: install the Rust toolchain (https://rustup.rs), then run this again"
    if [ "$(id -u)" = 0 ] && ! dpkg-query -W -f='${Status}' pkg-config libssl-dev 2>/dev/null | grep -c 'ok installed' | grep -qx 2; then
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq pkg-config libssl-dev >/dev/null
    fi
    say "building the gateway and the control plane (release)"
    (cd "$ROOT" && cargo build --release -q -p nvmeof-gateway -p control-plane)
}

ctl() { timeout -k 5 30 "$BIN/nvmeofctl" --server "127.0.0.1:$CONTROL_PORT" "$@"; }

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# alive PID: the process exists and is not a zombie (whatever it runs yet)
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}

# spawn NAME PORT CMD...: start in the background, wait until it listens on the port.
# Ready: the child has exec'd into the daemon (its comm is nvmeof-gateway / nvmeof-control,
# so `running` and `stop` recognise it) and the port accepts connections. Until then the
# child may still be the forked shell or setsid (on a loaded machine for tens of ms), which
# is not an exit: an exit is the PID gone or a zombie, and is reported with its status and
# the log's tail.
spawn() {
    local name=$1 port=$2 comm pid rc; shift 2
    comm=$(comm_of "$name")
    # another process on the port would pass for ours below
    listening "$port" && die "127.0.0.1:$port is in use already (DEMO_PORT / DEMO_CONTROL_PORT choose others)"
    # (setsid execs in the forked child: $! is the daemon's own PID)
    RUST_LOG=${RUST_LOG:-info} NO_COLOR=1 setsid "$@" >"$DIR/$name.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" > "$DIR/$name.pid"
    for _ in $(seq 300); do
        if ! alive "$pid"; then
            rc=0; wait "$pid" 2>/dev/null || rc=$?
            tail -n 20 "$DIR/$name.log" >&2
            die "$name exited with status $rc (log: $DIR/$name.log)"
        fi
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] && listening "$port" && return 0
        sleep 0.1
    done
    die "$name not listening on 127.0.0.1:$port after 30 s (log: $DIR/$name.log)"
}

write_memory_config() {
    cat > "$DIR/gateway.toml" <<EOF2
# Written by scripts/demo.sh
[gateway]
name = "demo"
metrics_listen = "127.0.0.1:$METRICS_PORT"

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
metrics_listen = "127.0.0.1:$(( METRICS_PORT + n - 1 ))"

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

From a Linux host with nvme-cli and the nvme-tcp module:
  on this machine (its own kernel):
    nvme discover -t tcp -a 127.0.0.1 -s $PORT
    nvme connect  -t tcp -a 127.0.0.1 -s $PORT -n $NQN
  in the test VM (tests/vm/run-in-vm.sh), which reaches this machine's 127.0.0.1 as 10.0.2.2:
    nvme discover -t tcp -a 10.0.2.2 -s $PORT
    nvme connect  -t tcp -a 10.0.2.2 -s $PORT -n $NQN
  then:
    nvme list
    nvme disconnect -n $NQN

Metrics (Prometheus): curl -s http://127.0.0.1:$METRICS_PORT/metrics
Gateway log: $DIR/gateway.log    config: $DIR/gateway.toml
Stop everything: scripts/demo.sh stop
EOF2
}

# gw1 reports ANA group 1 optimized (nvmeofctl ana show)
gw1_optimized() {
    ctl -o json ana show 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
ok = any(s.get("gateway") == "gw1" and s.get("ana_group") == 1 and s.get("state") in (1, "optimized")
         for s in d.get("states", []))
sys.exit(0 if ok else 1)' 2>/dev/null
}

start_group() {
    local envl
    say "starting micro Ceph in $CEPH_DIR"
    envl=$("$ROOT/scripts/micro-ceph.sh" start --dir "$CEPH_DIR" --image demo --size "$SIZE") ||
        die "micro-ceph.sh start failed"
    eval "$envl"
    say "starting the control plane on 127.0.0.1:$CONTROL_PORT (state: RADOS object nvmeof.demo.state in pool $MICRO_CEPH_POOL)"
    spawn control "$CONTROL_PORT" "$BIN/nvmeof-control" --listen "127.0.0.1:$CONTROL_PORT" --id control1 \
        --group demo --pool "$MICRO_CEPH_POOL" --ceph-conf "$CEPH_CONF" --keyring "$CEPH_KEYRING" \
        --metrics-listen "127.0.0.1:$(( METRICS_PORT + 2 ))"
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
    local served=0
    for _ in $(seq 150); do
        gw1_optimized && { served=1; break; }
        sleep 0.2
    done
    ctl ana show | sed 's/^/    /' >&2 || true
    [ $served = 1 ] || die "gw1 did not report ANA group 1 optimized within 30 s (logs: $DIR/gw1.log, $DIR/control.log)"
    cat <<EOF2

Two gateways serve RBD image $MICRO_CEPH_POOL/$MICRO_CEPH_IMAGE ($SIZE) as namespace 1 of subsystem
$NQN: gw1 on 127.0.0.1:$PORT (ANA optimized), gw2 on 127.0.0.1:$(( PORT + 1 ))
(inaccessible until gw1 goes away). The control plane (127.0.0.1:$CONTROL_PORT) keeps the
configuration in RADOS.

From a Linux host with nvme-cli and the nvme-tcp module:
  on this machine (its own kernel):
    nvme discover -t tcp -a 127.0.0.1 -s $PORT
    nvme connect-all -t tcp -a 127.0.0.1 -s $PORT     # both paths (native multipath)
  in the test VM (tests/vm/run-in-vm.sh), which reaches this machine's 127.0.0.1 as 10.0.2.2
  (the discovery log names 127.0.0.1, so connect each path by its address):
    nvme discover -t tcp -a 10.0.2.2 -s $PORT
    nvme connect  -t tcp -a 10.0.2.2 -s $PORT -n $NQN
    nvme connect  -t tcp -a 10.0.2.2 -s $(( PORT + 1 )) -n $NQN
  then:
    nvme list-subsys
    nvme disconnect -n $NQN

Manage it: $BIN/nvmeofctl --server 127.0.0.1:$CONTROL_PORT ana show | namespace list | gateway list | ...
Fail over:  kill -9 \$(cat $DIR/gw1.pid)   (gw2 becomes optimized after the fence)
Metrics:    curl -s http://127.0.0.1:$METRICS_PORT/metrics (gw1), :$(( METRICS_PORT + 1 ))/metrics (gw2),
            :$(( METRICS_PORT + 2 ))/metrics (control plane)
Logs:       $DIR/{control,gw1,gw2}.log
Ceph:       CEPH_CONF=$CEPH_CONF rbd ls $MICRO_CEPH_POOL
Stop everything: scripts/demo.sh stop
EOF2
}

# On a failed start: stop what was started, keep the logs (the cluster's too).
start_failed() {
    local rc=$?
    [ $rc -eq 0 ] && return 0
    say "start failed: stopping what was started (logs kept in $DIR)"
    if [ -d "$CEPH_DIR/log" ]; then
        mkdir -p "$DIR/ceph-log"
        cp "$CEPH_DIR"/log/*.log "$DIR/ceph-log/" 2>/dev/null || true
    fi
    (stop_processes) || say "could not stop everything: run scripts/demo.sh stop"
    exit $rc
}

start() {
    if any_running; then
        say "already running; 'scripts/demo.sh stop' first to restart"
        exit 0
    fi
    case $BACKEND in rbd | memory) ;; *) die "DEMO_BACKEND must be rbd or memory, not '$BACKEND'" ;; esac
    local p ports="$PORT $METRICS_PORT"
    [ "$BACKEND" = rbd ] && ports="$PORT $(( PORT + 1 )) $CONTROL_PORT $METRICS_PORT $(( METRICS_PORT + 1 )) $(( METRICS_PORT + 2 ))"
    for p in $ports; do
        listening "$p" && die "127.0.0.1:$p is in use already (DEMO_PORT / DEMO_CONTROL_PORT / DEMO_METRICS_PORT choose others)"
    done
    mkdir -p "$DIR"
    echo "$BACKEND" > "$DIR/backend"
    trap start_failed EXIT
    build
    if [ "$BACKEND" = rbd ]; then start_group; else start_memory; fi
    trap - EXIT
}

# status and stop: the backend the demo in $DIR was started with, whatever DEMO_BACKEND says now
recorded_backend() { [ -f "$DIR/backend" ] && BACKEND=$(cat "$DIR/backend"); return 0; }

case ${1:-start} in
    start) start ;;
    stop) recorded_backend; stop ;;
    status) recorded_backend; status ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' ;;
    *) die "unknown command $1 (start, stop, status)" ;;
esac
