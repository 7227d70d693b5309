#!/usr/bin/env bash
# bench-scale.sh - control-plane scale figures against a real (micro) Ceph:
#   1. the time for nvmeof-control to apply N namespaces through the admin gRPC API (one
#      NamespaceAdd per namespace, as nvmeofctl sends them; control-plane/examples/scale.rs),
#      per batch of 100 so the growth with the state size shows, against a read-only RPC as
#      the baseline;
#   2. the cost of nvmeofctl itself: a process per namespace, as a shell loop would do,
#      against `nvmeofctl namespace add-many` (one process, one connection);
#   3. a gateway (target/release/nvmeof-gateway, [group] member, no subsystem in its file)
#      starting with the N namespaces pushed by the control plane: time until they are all
#      served and until its ANA group is optimized, RSS, threads; memory per namespace is
#      (RSS with N - RSS of the same gateway serving the same subsystem with 0) / N;
#   4. M more namespaces (a second subsystem) added while that gateway runs (every add is
#      pushed to it);
#   baseline for 3: the same images opened by librbd alone in one process (the gateway's
#   ClusterPool, 8 opens at a time as the gateway does): time and RSS per image.
#
#   scripts/bench-scale.sh [N] [M]        (defaults 1000 and 200)
#
# Starts its own micro Ceph (memstore) in a temporary directory and stops everything it
# started on exit. Release build (BENCH_NO_BUILD=1: use target/release as it is;
# BENCH_KEEP=1: keep the logs). Prints `scale:` key=value lines and a summary.
set -euo pipefail

N=${1:-1000}
M=${2:-200}
CLI_SAMPLE=${CLI_SAMPLE:-50}
CLI_MANY=${CLI_MANY:-200}
ROOT=${BENCH_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
WORK=$(mktemp -d /tmp/bench-scale.XXXXXX)
export MICRO_CEPH_DIR=$WORK/ceph
export NO_COLOR=1
PIDS=()

cleanup() {
    local p
    for p in "${PIDS[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    for p in "${PIDS[@]}"; do
        wait "$p" 2>/dev/null || true
    done
    "$ROOT/scripts/micro-ceph.sh" stop "$MICRO_CEPH_DIR" >/dev/null 2>&1 || true
    if [ "${BENCH_KEEP:-0}" = 1 ]; then
        echo "logs kept in $WORK" >&2
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

now() { echo "${EPOCHREALTIME}"; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
plain_log() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }
rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }
threads() { awk '/^Threads:/ { print $2 }' "/proc/$1/status"; }

# wait_log FILE PATTERN TIMEOUT_S: until the (colour-stripped) log matches
wait_log() {
    local deadline=$((SECONDS + $3))
    until plain_log "$1" | grep -qE "$2"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "bench-scale: timed out waiting for /$2/ in $1" >&2
            tail -20 "$1" >&2
            return 1
        fi
        sleep 0.05
    done
}

if [ "${BENCH_NO_BUILD:-0}" != 1 ]; then
    echo "== build (release)" >&2
    (cd "$ROOT" && cargo build --release -q -p nvmeof-gateway -p control-plane --bins --example scale)
fi
BIN=$ROOT/target/release
SCALE=$BIN/examples/scale

echo "== micro Ceph" >&2
eval "$("$ROOT/scripts/micro-ceph.sh" start --dir "$MICRO_CEPH_DIR" --image '')"

CP_PORT=$(free_port)
CP=127.0.0.1:$CP_PORT
GROUP=scale$$
RUST_LOG=warn "$BIN/nvmeof-control" --listen "$CP" --pool rbd --group "$GROUP" \
    >"$WORK/control.log" 2>&1 &
PIDS+=($!)
CTL=("$BIN/nvmeofctl" --server "$CP")
deadline=$((SECONDS + 30))
until "${CTL[@]}" subsystem list >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || { cat "$WORK/control.log" >&2; exit 1; }
    sleep 0.1
done

[ "$N" -le 1024 ] && [ $((M + CLI_SAMPLE + CLI_MANY)) -le 1024 ] || {
    echo "bench-scale: at most 1024 namespaces per subsystem (MNAN)" >&2
    exit 2
}
echo "== $((N + M + CLI_SAMPLE + CLI_MANY)) RBD images (setup)" >&2
"$SCALE" --server "$CP" --images-only --namespaces "$N"
"$SCALE" --server "$CP" --images-only --namespaces $((M + CLI_SAMPLE + CLI_MANY)) --prefix scale2

echo "== baseline: librbd alone opens the $N images" >&2
"$SCALE" --open-only --namespaces "$N"

NQN=nqn.2016-06.io.ceph-nvmeof-rs:scale
NQN2=nqn.2016-06.io.ceph-nvmeof-rs:scale2
"${CTL[@]}" subsystem add --nqn "$NQN" --allow-any-host >/dev/null

GW_PORT=$(free_port)
METRICS_PORT=$(free_port)
cat >"$WORK/gw1.toml" <<EOF
[gateway]
name = "gw1"
worker_threads = 2
metrics_listen = "127.0.0.1:$METRICS_PORT"

[group]
control_plane = ["$CP"]
ana_group = 1
beacon_interval_ms = 500

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = $GW_PORT

[ceph]
conf = "$CEPH_CONF"
EOF

GW_PID=
# start_gateway LOG NAMESPACES: starts gw1, waits until its /readyz answers 200 (what a
# Kubernetes readiness probe waits for: polled every 50 ms), the pushed subsystem with that
# many namespaces is served and group 1 is optimized; prints the times.
start_gateway() {
    local log=$1 count=$2 t0 t1 t2 ready=none i
    t0=$(now)
    RUST_LOG=info "$BIN/nvmeof-gateway" --config "$WORK/gw1.toml" >"$log" 2>&1 &
    GW_PID=$!
    PIDS+=("$GW_PID")
    for i in $(seq 1200); do
        if curl -sf -o /dev/null "http://127.0.0.1:$METRICS_PORT/readyz"; then
            ready=$(elapsed "$t0" "$(now)")
            break
        fi
        sleep 0.05
    done
    wait_log "$log" "pushed subsystem served.*namespaces=$count\b" 600
    t1=$(now)
    local optimized=none
    if wait_log "$log" "ANA state optimized" 60; then
        optimized=$(elapsed "$t0" "$(now)")
    fi
    echo "scale: gateway_start namespaces=$count ready_s=$ready served_s=$(elapsed "$t0" "$t1") optimized_s=$optimized"
}

stop_gateway() {
    kill -TERM "$GW_PID" 2>/dev/null || true
    wait "$GW_PID" 2>/dev/null || true
}

echo "== gateway with the subsystem and 0 namespaces (memory baseline)" >&2
start_gateway "$WORK/gw-0.log" 0
sleep 2
RSS0=$(rss_kib "$GW_PID")
echo "scale: gateway namespaces=0 rss_kib=$RSS0 threads=$(threads "$GW_PID")"
stop_gateway

echo "== $N namespaces through the admin API (no gateway connected)" >&2
"$SCALE" --server "$CP" --namespaces "$N" --first 1

echo "== gateway start with $N namespaces" >&2
start_gateway "$WORK/gw-n.log" "$N"
sleep 2
RSSN=$(rss_kib "$GW_PID")
echo "scale: gateway namespaces=$N rss_kib=$RSSN threads=$(threads "$GW_PID") per_namespace_kib=$(( (RSSN - RSS0) / N ))"

echo "== $M more namespaces (second subsystem) while the gateway runs" >&2
t0=$(now)
"$SCALE" --server "$CP" --namespaces "$M" --nqn "$NQN2" --prefix scale2 --batch 50
wait_log "$WORK/gw-n.log" "(pushed namespace served.*nsid=$M\b|pushed subsystem served.*scale2.*namespaces=$M\b)" 600
echo "scale: pushed_to_gateway namespaces=$M all_served_s=$(elapsed "$t0" "$(now)") rss_kib=$(rss_kib "$GW_PID")"
CPU_TICKS=$(awk '{ print $14 + $15 }' "/proc/$GW_PID/stat")
echo "scale: gateway cpu_s_total=$(awk -v t="$CPU_TICKS" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.2f", t / hz }')"

echo "== nvmeofctl, one process per namespace ($CLI_SAMPLE)" >&2
t0=$(now)
for i in $(seq $((M + 1)) $((M + CLI_SAMPLE))); do
    "${CTL[@]}" namespace add -n "$NQN2" --image "$(printf 'scale2-%05d' "$i")" --nsid "$i" \
        --ana-group 1 >/dev/null
done
t1=$(now)
echo "scale: nvmeofctl_namespace_add count=$CLI_SAMPLE seconds=$(elapsed "$t0" "$t1") per_add_ms=$(awk -v a="$t0" -v b="$t1" -v n="$CLI_SAMPLE" 'BEGIN { printf "%.1f", (b - a) * 1000 / n }')"
echo "== nvmeofctl namespace add-many, one process for $CLI_MANY" >&2
for i in $(seq $((M + CLI_SAMPLE + 1)) $((M + CLI_SAMPLE + CLI_MANY))); do
    printf 'scale2-%05d %d\n' "$i" "$i"
done >"$WORK/many.txt"
t0=$(now)
"${CTL[@]}" namespace add-many -n "$NQN2" --ana-group 1 --file "$WORK/many.txt" >/dev/null
t1=$(now)
echo "scale: nvmeofctl_add_many count=$CLI_MANY seconds=$(elapsed "$t0" "$t1") per_add_ms=$(awk -v a="$t0" -v b="$t1" -v n="$CLI_MANY" 'BEGIN { printf "%.1f", (b - a) * 1000 / n }')"
t0=$(now)
"${CTL[@]}" -o json namespace list >"$WORK/list.json"
echo "scale: nvmeofctl_namespace_list count=$(grep -c '"nsid"' "$WORK/list.json") seconds=$(elapsed "$t0" "$(now)")"
stop_gateway
