#!/usr/bin/env bash
# micro-ceph.sh - throwaway single-node Ceph (1 mon, 1 OSD, 1 mgr) on 127.0.0.1
# (or on MICRO_CEPH_IP),
# for the gateway's tests and demo. Adapted from shared/reference/ceph/micro-ceph.sh.
#
#   micro-ceph.sh start [--store memstore|bluestore] [--no-mgr] [--image NAME] [--size SIZE]
#                       [--dir DIR] [--port PORT] [--auth cephx|none]
#       Starts a ceph-mgr (mgr.x) with its always-on modules, rbd_support among them (what
#       `rbd trash purge schedule`, `rbd task add ...` and ceph-csi's DeleteVolume use), and
#       waits until `ceph mgr stat` says available; --no-mgr (or MICRO_CEPH_MGR=0) starts
#       none (a cluster without one answers no mgr command: `rbd task add` never returns).
#       Idempotent: if the cluster in DIR is already running, only prints its env.
#       Otherwise (re)creates DIR (default: $MICRO_CEPH_DIR, else ${TMPDIR:-/tmp}/nvmeof-micro-ceph),
#       starts the daemons, creates pool 'rbd' (size 1, 8 PGs), runs 'rbd pool init', creates
#       an image (default img0, 1G; --image '' for none), and prints eval-able export lines:
#           CEPH_CONF, CEPH_KEYRING, MICRO_CEPH_DIR, MICRO_CEPH_POOL, MICRO_CEPH_IMAGE
#       The same lines are in DIR/env. Missing Ceph packages are apt-installed when run as
#       root (MICRO_CEPH_NO_INSTALL=1 to refuse); otherwise it says what to install.
#   micro-ceph.sh stop [DIR]     kill exactly the PIDs listed in DIR/pids (SIGKILL, or SIGTERM
#                                with MICRO_CEPH_STOP_SIGNAL=TERM), then rm -rf DIR.
#                                Not running: nothing to do, exit 0.
#   micro-ceph.sh status [DIR]   exit 0 and print the env if mon and OSD run, else exit 1
#   micro-ceph.sh env [DIR]      print the export lines again
#   micro-ceph.sh restart-osd [DIR]   start osd.0 again after it died (fault tests)
#   micro-ceph.sh install        only install the packages (root; ceph-mgr too unless
#                                MICRO_CEPH_MGR=0)
#
# Usage:  eval "$(scripts/micro-ceph.sh start)"; rbd ls; scripts/micro-ceph.sh stop
#
# Environment knobs: MICRO_CEPH_VERBOSE=1 (step timings on stderr),
#   MICRO_CEPH_BLUESTORE_SIZE (default 10G, sparse file),
#   MICRO_CEPH_MEMSTORE_SIZE (bytes of RAM the memstore OSD may use, default 4 GiB),
#   MICRO_CEPH_EXTRA_CONF (raw text appended to ceph.conf, with its own [section]),
#   MICRO_CEPH_KEEP=1 (on a failed start, leave the daemons and DIR for debugging),
#   MICRO_CEPH_IP (the local IPv4 address every daemon binds, default 127.0.0.1; e.g. a docker
#   network's gateway address, so that containers on that network reach the cluster),
#   MICRO_CEPH_OSD_IP (the OSD's own local IPv4 address, default MICRO_CEPH_IP: so a test can
#   cut a client off the OSD and not the monitor),
#   MICRO_CEPH_FIRST_PORT (the port the first attempt tries instead of a picked one, as if
#   it had been taken after the pick; tests/micro-ceph-ports.sh checks the retry with it).
#
# Every daemon binds 127.0.0.1 (MICRO_CEPH_IP) only. The mon listens on a non-default port
# (msgr2 on PORT, msgr1 on PORT+1; picked in 10000-19999 unless --port is given, and
# picked again if the mon finds it taken). Daemons run in the foreground (-f) under
# setsid so that $! is the daemon's own PID; those PIDs go into DIR/pids.
# Start takes ~1 s (memstore) / ~2 s (bluestore) on 2 vCPUs without the mgr; the mgr adds
# ~1.5-2.5 s (waiting until it is available and rbd_support answers; measured 4.3-4.7 s
# against 1.7-2.0 s with --no-mgr, memstore, on a busy 2-core machine) and ~155 MB of RSS
# (~300 MB with every module of ceph-mgr-modules-core loaded, hence mgr_disabled_modules).
set -euo pipefail

die() { echo "micro-ceph: $*" >&2; exit 1; }
now_us() { echo "${EPOCHREALTIME/./}"; }
T0=$(now_us)
step() {
    [ "${MICRO_CEPH_VERBOSE:-0}" = 1 ] || return 0
    local d=$(( $(now_us) - T0 ))
    printf 'micro-ceph: %d.%02ds %s\n' $((d / 1000000)) $((d % 1000000 / 10000)) "$*" >&2
}

# No socket of any state uses the port: an outgoing connection's local port blocks the
# mon's bind (EADDRINUSE) as surely as a listener does.
port_unused() { ! ss -Htan "sport = :$1" | grep -q .; }

# An even port P with P and P+1 unused, in 10000-19999: below Linux's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default), where any outgoing connection on
# a busy machine may take a port after we checked it; below the 20000-31999 that the
# project's tests pick for gateways and control planes.
pick_port() {
    local p i
    for i in $(seq 1 50); do
        p=$(( 10000 + (RANDOM % 5000) * 2 ))
        if port_unused "$p" && port_unused "$((p + 1))"; then echo "$p"; return 0; fi
    done
    die "no free port pair found"
}

# Exit status of a start whose mon could not bind its port: the port was taken between
# pick_port and the bind. 'start' then tries again on a fresh port.
BIND_FAILED=75

# The mon's log says it could not bind its port (it would retry for 10 s, then die).
mon_bind_failed() { grep -q 'unable to bind' "$DIR/log/mon.a.log" 2>/dev/null; }
# mon_bound_or_failed PID PORT: the mon PID listens on PORT (not some other process), or
# it could not bind.
mon_bound_or_failed() { mon_bind_failed || ss -Hltnp "sport = :$2" | grep -q "pid=$1,"; }

# the address every daemon binds; only a local IPv4 address makes sense
IP=${MICRO_CEPH_IP:-127.0.0.1}
[[ $IP =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "MICRO_CEPH_IP must be an IPv4 address, not '$IP'"
OSD_IP=${MICRO_CEPH_OSD_IP:-$IP}
[[ $OSD_IP =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "MICRO_CEPH_OSD_IP must be an IPv4 address, not '$OSD_IP'"

default_dir() { echo "${MICRO_CEPH_DIR:-${TMPDIR:-/tmp}/nvmeof-micro-ceph}"; }

print_env() {
    cat "$1/env"
}

CEPH_PACKAGES="ceph-mon ceph-osd ceph-common uuid-runtime iproute2"

# ensure_packages [mgr]: install what is missing (root + apt), or say what to install.
# 'mgr' adds Debian's ceph-mgr (with ceph-mgr-modules-core and its Python dependencies;
# ~50 MB more, recommends left out as for the others).
ensure_packages() {
    local missing=0 b pkgs=$CEPH_PACKAGES
    for b in ceph-mon ceph-osd ceph-authtool monmaptool ceph rbd ss uuidgen setsid; do
        command -v "$b" >/dev/null || missing=1
    done
    if [ "${1:-}" = mgr ]; then
        command -v ceph-mgr >/dev/null || missing=1
        pkgs="$pkgs ceph-mgr"
    fi
    [ "$missing" = 1 ] || return 0
    if [ "$(id -u)" != 0 ] || [ "${MICRO_CEPH_NO_INSTALL:-0}" = 1 ] || ! command -v apt-get >/dev/null; then
        die "Ceph tools missing; install them: apt-get install --no-install-recommends $pkgs"
    fi
    echo "micro-ceph: installing $pkgs" >&2
    # another apt may be running (CI images, unattended upgrades): wait for its lock
    local apt=(apt-get -y -q -o DPkg::Lock::Timeout=600)
    if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" install --no-install-recommends $pkgs >&2; then
        "${apt[@]}" update >&2 || die "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive "${apt[@]}" install --no-install-recommends $pkgs >&2 \
            || die "apt-get install $pkgs failed"
    fi
}

# running DIR: true while every daemon listed in DIR/pids is alive
running() {
    local dir=$1 pid name comm n=0
    [ -f "$dir/pids" ] && [ -f "$dir/env" ] || return 1
    while read -r pid name comm; do
        is_ours "$pid" "$comm" || return 1
        n=$((n + 1))
    done <"$dir/pids"
    [ "$n" -ge 2 ]
}

# wait_for SECONDS DESCRIPTION COMMAND... : poll every 0.1 s
wait_for() {
    local t=$1 what=$2; shift 2
    local end=$(( $(now_us) + t * 1000000 ))
    until "$@" >/dev/null 2>&1; do
        if [ "$(now_us)" -gt "$end" ]; then
            die "timeout after ${t}s waiting for: $what (logs in $DIR/log)"
        fi
        sleep 0.1
    done
}

# start_daemon NAME CMD... : run CMD in the foreground under setsid, record its PID.
start_daemon() {
    local name=$1; shift
    setsid "$@" </dev/null >>"$DIR/log/$name.stdout" 2>&1 &
    local pid=$!
    echo "$pid $name $(basename "$1")" >>"$DIR/pids"
    step "started $name pid $pid"
}

# is_ours PID COMM: true while PID is alive (not a zombie) and still runs the
# binary we started. Daemons are reparented to PID 1 once 'start' exits, and a
# killed one can linger as a zombie until PID 1 reaps it: that counts as gone.
is_ours() {
    local stat
    [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}

# stop_pids SIGNAL TIMEOUT_TENTHS PID:COMM... : signal, then wait until all are gone
stop_pids() {
    local sig=$1 tenths=$2; shift 2
    local e alive
    for e in "$@"; do is_ours "${e%%:*}" "${e#*:}" && kill "-$sig" "${e%%:*}" 2>/dev/null; done
    for _ in $(seq 1 "$tenths"); do
        alive=0
        for e in "$@"; do is_ours "${e%%:*}" "${e#*:}" && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 0.1
    done
    return 1
}

do_stop() {
    DIR=${1:-$(default_dir)}
    if [ ! -f "$DIR/pids" ]; then
        # nothing was started (or a start died before its first daemon)
        [ ! -d "$DIR" ] || [ -n "$(ls -A "$DIR" 2>/dev/null)" ] || rmdir "$DIR" 2>/dev/null || true
        if [ -d "$DIR" ] && [ -f "$DIR/ceph.conf" ]; then rm -rf "$DIR"; fi
        return 0
    fi
    local pid name comm mons=() others=() all=()
    while read -r pid name comm; do
        case "$name" in mon.*) mons+=("$pid:$comm") ;; *) others+=("$pid:$comm") ;; esac
        all+=("$pid:$comm")
    done <"$DIR/pids"
    # Default: SIGKILL all (the cluster is thrown away; a memstore OSD would
    # otherwise serialise its whole store to disk on exit). With
    # MICRO_CEPH_STOP_SIGNAL=TERM: OSD/mgr first while the mon can still ack their
    # "going down" message (with the mon already gone an OSD waits
    # osd_mon_shutdown_timeout = 5 s), then the mon, then SIGKILL for leftovers.
    if [ "${MICRO_CEPH_STOP_SIGNAL:-KILL}" = KILL ]; then
        stop_pids KILL 50 "${all[@]}" || true
    else
        [ ${#others[@]} -eq 0 ] || stop_pids TERM 30 "${others[@]}" || true
        [ ${#mons[@]} -eq 0 ] || stop_pids TERM 30 "${mons[@]}" || true
        if ! stop_pids KILL 50 "${all[@]}"; then
            die "some daemons of $DIR did not die; directory kept"
        fi
    fi
    rm -rf "$DIR"
}

do_start() {
    local store=memstore mgr=${MICRO_CEPH_MGR:-1} image=img0 size=1G port="" auth=cephx
    DIR=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --store) store=$2; shift 2 ;;
            --mgr) mgr=1; shift ;;
            --no-mgr) mgr=0; shift ;;
            --image) image=$2; shift 2 ;;
            --size) size=$2; shift 2 ;;
            --dir) DIR=$2; shift 2 ;;
            --port) port=$2; shift 2 ;;
            --auth) auth=$2; shift 2 ;;
            *) die "unknown option $1" ;;
        esac
    done
    case "$store" in memstore|bluestore) ;; *) die "--store must be memstore or bluestore" ;; esac
    case "$auth" in cephx|none) ;; *) die "--auth must be cephx or none" ;; esac
    [ -n "$DIR" ] || DIR=$(default_dir)
    if running "$DIR"; then
        echo "micro-ceph: already running in $DIR" >&2
        print_env "$DIR"
        return 0
    fi
    if [ "$mgr" = 1 ]; then ensure_packages mgr; else ensure_packages; fi
    if [ -e "$DIR" ]; then
        # leftovers of a dead or half-started cluster: kill what is ours, start afresh
        if [ -f "$DIR/pids" ]; then
            do_stop "$DIR" || die "cannot clean up $DIR"
        elif [ -n "$(ls -A "$DIR")" ] && [ ! -f "$DIR/ceph.conf" ]; then
            die "$DIR is not empty and not a micro-ceph directory"
        else
            rm -rf "$DIR"
        fi
    fi
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    # if anything below fails, tear down what was started
    trap 'rc=$?; if [ $rc -ne 0 ] && [ "${MICRO_CEPH_KEEP:-0}" != 1 ]; then echo "micro-ceph: start failed, stopping (logs were in $DIR/log)" >&2; tail -n 20 "$DIR"/log/*.log >&2 2>/dev/null || true; do_stop "$DIR" || true; fi' EXIT

    if [ -z "$port" ] && [ "${MICRO_CEPH_ATTEMPT:-1}" = 1 ]; then port=${MICRO_CEPH_FIRST_PORT:-}; fi
    [ -n "$port" ] || port=$(pick_port)
    local fsid; fsid=$(uuidgen)
    local osd_uuid; osd_uuid=$(uuidgen)
    mkdir -p "$DIR"/{log,run,mon,osd,mgr,crash}
    : >"$DIR/pids"
    local conf=$DIR/ceph.conf keyring=$DIR/ceph.client.admin.keyring
    # MemStore's byte count can go negative (seen in CI after discards: used -968210), and
    # its statfs then reports more available than total; the OSD's used = total -
    # available wraps to 2^64, it engages the full failsafe and drops every write, so
    # clients hang. With fake_statfs_for_testing the OSD counts used bytes from its PG
    # stats instead (OSDService::set_statfs).
    local fake_statfs=""
    if [ "$store" = memstore ]; then
        fake_statfs="fake_statfs_for_testing = ${MICRO_CEPH_MEMSTORE_SIZE:-4294967296}"
    fi

    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon_host = [v2:$IP:$port,v1:$IP:$((port + 1))]
public_addr = $IP
cluster_addr = $IP
auth_cluster_required = $auth
auth_service_required = $auth
auth_client_required = $auth
keyring = $keyring
run_dir = $DIR/run
crash_dir = $DIR/crash
admin_socket = $DIR/run/\$cluster-\$name.asok
log_file = $DIR/log/\$name.log
mon_cluster_log_file = $DIR/log/cluster.log
log_to_stderr = false
err_to_stderr = false
# single node, single replica
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_warn_on_insecure_global_id_reclaim_allowed = false
mon_data_avail_warn = 1
mon_data_avail_crit = 0
# faster map updates (default 1 s batching)
paxos_propose_interval = 0.05
mon_osd_auto_mark_new_in = true

[mon]
mon_data = $DIR/mon
keyring = $DIR/mon/keyring
# read by the mon at mkfs time (in [mgr] it is ignored); defaults: iostat nfs restful.
# None but the always-on ones (see [mgr]); a name is needed, and an always-on one is
# harmless here.
mgr_initial_modules = status

[osd]
public_addr = $OSD_IP
cluster_addr = $OSD_IP
osd_data = $DIR/osd
keyring = $DIR/osd/keyring
osd_objectstore = $store
memstore_device_bytes = ${MICRO_CEPH_MEMSTORE_SIZE:-4294967296}
$fake_statfs
# page-based objects: with the default (false) every small write into a 4 MiB
# object re-copies bufferlists; 4K random I/O was 1.7-7x slower and RSS kept growing
memstore_page_set = true
# bluestore_block_path left unset: mkfs then creates the sparse file osd/block
# itself (setting it to \$osd_data/block makes mkfs symlink block -> block: ELOOP)
bluestore_block_size = ${MICRO_CEPH_BLUESTORE_SIZE:-10G}
bluestore_block_create = true
bluestore_fsck_on_mkfs = false
bluestore_fsck_on_mount = false
# each bdev close waits up to one aio poll period (default 250 ms) and mkfs/boot
# open+close the block file ~10 times: 10 ms cut bluestore start from ~4.7 s to ~2.4 s
bdev_aio_poll_ms = 10
osd_crush_update_on_start = true

[mgr]
mgr_data = $DIR/mgr
keyring = $DIR/mgr/keyring
# Only the always-on modules (rbd_support among them) are loaded: the mgr imports every
# module it finds, enabled or not. With every module of Debian's ceph-mgr-modules-core
# loaded its RSS was ~300 MB here.
mgr_disabled_modules = alerts diskprediction_local influx insights iostat localpool mirroring nfs osd_perf_query osd_support prometheus restful selftest snap_schedule stats telegraf test_orchestrator zabbix

[client]
# clients all run as client.admin: one admin socket per process, or the second
# concurrent client prints "AdminSocket::bind_and_listen: failed to bind"
admin_socket = $DIR/run/\$cluster-\$name.\$pid.asok
log_file = $DIR/log/\$name.\$pid.log
EOF
    # extra raw ceph.conf text, e.g. MICRO_CEPH_EXTRA_CONF=$'[osd]\nosd_op_num_shards = 2'
    [ -z "${MICRO_CEPH_EXTRA_CONF:-}" ] || printf '\n%s\n' "$MICRO_CEPH_EXTRA_CONF" >>"$conf"
    export CEPH_CONF=$conf
    # CEPH_KEYRING/CEPH_ARGS in the environment override the per-daemon 'keyring'
    # settings (an OSD given the admin keyring fails cephx with "End of buffer"),
    # so never pass them to the daemons; clients find the admin keyring via [global].
    unset CEPH_ARGS CEPH_KEYRING
    step "conf written (port $port, store $store, auth $auth)"

    # keys: mon., client.admin, osd.0 and mgr.x all go into the mon's mkfs keyring,
    # so no 'ceph auth' round trips are needed later.
    local mk=$DIR/mkfs.keyring
    {
    ceph-authtool --create-keyring "$mk" --gen-key -n mon. --cap mon 'allow *'
    ceph-authtool --create-keyring "$keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *'
    ceph-authtool --create-keyring "$DIR/osd/keyring" --gen-key -n osd.0 \
        --cap mon 'allow profile osd' --cap mgr 'allow profile osd' --cap osd 'allow *'
    ceph-authtool --create-keyring "$DIR/mgr/keyring" --gen-key -n mgr.x \
        --cap mon 'allow profile mgr' --cap osd 'allow *' --cap mds 'allow *'
    ceph-authtool "$mk" --import-keyring "$keyring"
    ceph-authtool "$mk" --import-keyring "$DIR/osd/keyring"
    ceph-authtool "$mk" --import-keyring "$DIR/mgr/keyring"
    } >/dev/null
    monmaptool --create --fsid "$fsid" \
        --addv a "[v2:$IP:$port,v1:$IP:$((port + 1))]" "$DIR/monmap" >/dev/null
    step "keys + monmap"

    ceph-mon --mkfs -i a --monmap "$DIR/monmap" --keyring "$mk"
    step "mon mkfs"
    start_daemon mon.a ceph-mon -f -i a
    # $!: start_daemon's setsid, which is the mon itself
    wait_for 60 "mon.a to listen on $IP:$port" mon_bound_or_failed "$!" "$port"
    if mon_bind_failed; then
        echo "micro-ceph: mon.a could not bind $IP:$port (taken after it was picked)" >&2
        exit "$BIND_FAILED"
    fi
    # 'ceph osd new' is the first mon round trip; it also proves the mon is up
    local osd_id
    osd_id=$(timeout 60 ceph --connect-timeout 30 osd new "$osd_uuid" 0)
    [ "$osd_id" = 0 ] || die "expected osd id 0, got '$osd_id'"
    step "mon up, osd.0 allocated"
    if [ "$mgr" = 1 ]; then
        # Started now, so that its start (~2-3 s of Python module loading) overlaps the OSD's
        # mkfs and boot. Module options live in the mon's config db (ceph.conf is not read
        # for them); without this devicehealth creates a pool 'device_health_metrics'.
        # --force: the mon does not know module options before a mgr registered them.
        ceph config set mgr mgr/devicehealth/enable_monitoring false --force
        start_daemon mgr.x ceph-mgr -f -i x
    fi

    ceph-osd --mkfs -i 0 --osd-uuid "$osd_uuid" >>"$DIR/log/osd.0.mkfs" 2>&1 \
        || die "osd mkfs failed: $(tail -n 5 "$DIR/log/osd.0.mkfs")"
    step "osd mkfs ($store)"
    start_daemon osd.0 ceph-osd -f -i 0

    ceph osd pool create rbd 8 8 replicated >/dev/null 2>&1
    step "pool created"
    # Wait until the OSD is up before the first client I/O: an op sent while the
    # client's osdmap still shows the OSD down waits for the next objecter tick
    # (objecter_tick_interval = 5 s) before the client asks for a newer map.
    wait_for 120 "osd.0 to boot" grep -q 'state: booting -> active' "$DIR/log/osd.0.log"
    step "osd.0 up"
    # blocks until the PGs are active (it writes the rbd_info object)
    timeout 120 rbd pool init rbd
    step "rbd pool init"
    if [ -n "$image" ]; then
        timeout 60 rbd create --size "$size" "rbd/$image"
        step "image rbd/$image created"
    fi
    if [ "$mgr" = 1 ]; then
        wait_for 60 "mgr.x to be available (ceph mgr stat)" mgr_available
        step "mgr.x available"
        # rbd_support is one of the mgr's always-on modules (Pacific and later), but it
        # answers only once the mgr has loaded it: wait for its 'rbd task list'. A Ceph
        # where it is not always on says ENOTSUP ("not enabled"): enable it, and wait again.
        if ! wait_until 30 rbd_support_answers; then
            timeout 30 ceph mgr module enable rbd_support --force >/dev/null 2>&1 || true
            step "rbd_support enabled"
            wait_for 60 "the mgr's rbd_support module to answer (ceph rbd task list)" rbd_support_answers
        fi
        step "rbd_support answers"
    fi

    cat >"$DIR/env" <<EOF
export CEPH_CONF=$conf
export CEPH_KEYRING=$keyring
export MICRO_CEPH_DIR=$DIR
export MICRO_CEPH_POOL=rbd
export MICRO_CEPH_IMAGE=$image
EOF
    trap - EXIT
    print_env "$DIR"
}

# wait_until SECONDS COMMAND...: like wait_for, but false instead of dying on the timeout
wait_until() {
    local end=$(( $(now_us) + $1 * 1000000 )); shift
    until "$@" >/dev/null 2>&1; do
        [ "$(now_us)" -le "$end" ] || return 1
        sleep 0.1
    done
}

# the mgr's rbd_support module answers (its commands are what 'rbd task add' sends)
rbd_support_answers() { timeout 10 ceph rbd task list >/dev/null 2>&1; }

# the cluster has an active mgr ('ceph mgr stat': "available": true)
mgr_available() {
    timeout 10 ceph mgr stat --format json 2>/dev/null | grep -q '"available": *true'
}

# restart-osd DIR: start osd.0 again (after it was killed), append the new PID
do_restart_osd() {
    DIR=${1:-$(default_dir)}
    [ -f "$DIR/pids" ] || die "$DIR/pids not found"
    local pid name comm
    while read -r pid name comm; do
        [ "$name" = osd.0 ] && is_ours "$pid" "$comm" && die "osd.0 still running as $pid"
    done <"$DIR/pids"
    # forget the dead PID so that 'stop' can never hit a recycled one
    grep -v ' osd\.0 ' "$DIR/pids" >"$DIR/pids.new" || true
    mv "$DIR/pids.new" "$DIR/pids"
    export CEPH_CONF=$DIR/ceph.conf
    unset CEPH_ARGS CEPH_KEYRING
    start_daemon osd.0 ceph-osd -f -i 0
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    start)
        # A port we picked can still be taken before the mon binds it; then start again on
        # a fresh one. Not 'do_start || rc=$?': bash runs a tested subshell without set -e.
        for attempt in 1 2 3; do
            set +e
            (set -e; MICRO_CEPH_ATTEMPT=$attempt do_start "$@")
            rc=$?
            set -e
            [ "$rc" = "$BIND_FAILED" ] && [[ " $* " != *" --port "* ]] || exit "$rc"
            echo "micro-ceph: mon.a could not bind its port; starting again on another (attempt $((attempt + 1)) of 3)" >&2
        done
        exit "$rc" ;;
    stop) do_stop "$@" ;;
    env)
        d=${1:-$(default_dir)}
        [ -f "$d/env" ] || die "no cluster in $d"
        print_env "$d" ;;
    status)
        d=${1:-$(default_dir)}
        if running "$d"; then print_env "$d"; echo "micro-ceph: running in $d" >&2
        else echo "micro-ceph: not running (dir $d)" >&2; exit 1; fi ;;
    install) if [ "${MICRO_CEPH_MGR:-1}" = 1 ]; then ensure_packages mgr; else ensure_packages; fi ;;
    restart-osd) do_restart_osd "$@" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
