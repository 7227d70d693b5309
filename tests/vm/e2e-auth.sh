#!/bin/bash
# e2e-auth.sh - NVMe in-band authentication (DH-HMAC-CHAP) of OUR gateway, checked with the
# real Linux host (nvme-cli + the kernel's nvme-tcp). Runs INSIDE the test VM, which must boot
# a kernel with NVMe auth (Debian bookworm's 6.1 has none; bookworm-backports' 6.12 has it):
#
#   eval "$(tests/vm/get-bpo-kernel.sh)"
#   tests/vm/run-in-vm.sh -t 900 -w target/vm-logs tests/vm/e2e-auth.sh target/release/nvmeof-gateway
#
# usage: e2e-auth.sh [--kernel-target] <path-to-nvmeof-gateway>
#   --kernel-target  the same steps against the kernel's nvmet (configfs: per-host dhchap_key,
#                    dhchap_ctrl_key, dhchap_hash, dhchap_dhgroup, null_blk namespaces); proves
#                    the script, nvme-cli and the host. Checks of the gateway's own log lines
#                    print a SKIP line and count as skipped.
#
# Keys come from `nvme gen-dhchap-key`; every host NQN has its own host ID. The gateway gets
# one config (/tmp/e2e-auth/gateway.toml): subsystem ...:auth (64 MiB in memory) whose hosts
# are tables with dhchap_key (+ dhchap_ctrl_key), and subsystem ...:open whose host list is
# the plain NQN of the main host. It listens on 127.0.0.1:$E2E_PORT (4420); the negotiation
# steps start a second gateway on port +1, one config per case. Steps (timed, PASS/FAIL):
#   kernel.auth        the guest kernel has NVMe auth (host, and target with --kernel-target):
#                      FAILS, and nothing else runs, on a kernel without it
#   keys               keys for every host (--hmac=0..3; 1/2/3 are 32/48/64 bytes)
#   a.*                unidirectional: connect with --dhchap-secret; the host says it
#                      authenticated with the defaults hmac(sha512)/ffdhe2048 and did not
#                      authenticate the controller; the gateway logs "queue authenticated" for
#                      qid 0 and every I/O queue (bidirectional=false); fio crc32c verify 8M;
#                      nvme list-subsys and sysfs (state, dhchap_secret, dhchap_ctrl_secret);
#                      disconnect
#   b.*                bidirectional (--dhchap-ctrl-secret): the host authenticated the
#                      controller; the gateway logs bidirectional=true; fio verify 8M
#   c.reauth           the same secret written to /sys/class/nvme/nvmeX/dhchap_secret: the host
#                      re-authenticates qid 0 and every I/O queue on the live connection (each
#                      sends success2: the gateway's answers checked); more "queue
#                      authenticated" gateway lines than before; fio verify 4M
#   d.wrong-host-key   connect fails (host: "authentication failed"), the gateway logs
#                      "authentication failed" with a reason=, is alive and d2 connects a good host
#   e.no-secret        a host that has a key connects without --dhchap-secret: fails ("no key")
#   f.wrong-ctrl-key   --dhchap-ctrl-secret not the gateway's: the host refuses the controller
#                      ("controller authentication failed"); no "queue authenticated" for it
#   x1.no-ctrl-key     a host asks for bidirectional auth, the target has no ctrl key for it:
#                      connect fails
#   g.hmac-0..3        keys generated with each transform (--hmac=0,1,2,3; host and ctrl key),
#                      each connects bidirectionally
#   n.HASH-DHGROUP     [gateway] dhchap_hashes / dhchap_dhgroups restricted to one value (every
#                      hash and every DH group once, 6 cases): the host and the gateway log say
#                      that hash and group (kernel target: that host's dhchap_hash/dhgroup)
#   i.no-auth-host     a host allowed without a key in subsystem ...:open connects although it
#                      passes --dhchap-secret: no authentication (no ATR), fio verify 8M
#   j.digests-auth     --hdr-digest --data-digest with bidirectional auth: every queue's ICResp
#                      grants both digests (captured on lo), fio verify 8M
#   r.rdma-bidirectional  nvme-rdma over Soft-RoCE (rxe0 on eth0, $RDMA_ADDR; the gateway's
#                      rdma listener), bidirectional: every queue authenticated, fio verify 8M
#                      (kernel target: skipped)
#   r2.rdma-failure2-repeat  over nvme-rdma, a wrong --dhchap-ctrl-secret $FAILURE2_RUNS times
#                      (20): the host sends Failure2, the gateway ends the controller and closes
#                      the queue pair; each connect must fail within $FAILURE2_BOUND s (30) with
#                      "controller authentication failed", none may hang (before the gateway
#                      waited for the send completion of the reply posted just before the close,
#                      the disconnect could flush it: the host timed the command out after 60 s,
#                      twice, and the connect hung ~370 s; 3 of 9 attempts in one run). Prints the
#                      hang count and the slowest attempt; stops at the first hang unless
#                      FAILURE2_KEEP_GOING=1 (kernel target: skipped)
#   s.reload           SIGHUP reload while the main host runs fio verify on ...:open (untouched):
#                      the file gains subsystem ...:added and the main host's key on ...:auth
#                      changes; the gateway logs "configuration reloaded", the added subsystem
#                      serves, the new key connects, fio verify passes and the untouched
#                      controller never reconnected (same cntlid, live, no reconnect in dmesg)
#                      (kernel target: skipped)
#   k.sigterm          the gateway exits 0 on SIGTERM (kernel target: nvmet torn down)
# Last line: "N passed, N failed". Exit 0 only if nothing failed.
#
# Env: E2E_LOG_DIR (default ./target/vm-logs if writable, else /tmp/e2e-logs; logs in
#      $E2E_LOG_DIR/e2e-auth), E2E_PORT (default 4420; the negotiation target uses +1),
#      RUST_LOG (default info), FAILURE2_RUNS (20), FAILURE2_BOUND (30 s), FAILURE2_KEEP_GOING=1,
#      E2E_AUTH_RDMA_ONLY=1 (only the setup and the nvme-rdma steps r and r2, then k).
set -u
export LC_ALL=C

MODE=gateway
if [ "${1:-}" = --kernel-target ]; then MODE=kernel; shift; fi
GW=${1:-}
if [ "$MODE" = gateway ]; then
  if [ -z "$GW" ]; then echo "usage: e2e-auth.sh [--kernel-target] <nvmeof-gateway binary>"; echo "0 passed, 1 failed"; exit 2; fi
  case $GW in /*) ;; *) GW=$PWD/$GW ;; esac
  if [ ! -x "$GW" ]; then echo "FAIL: gateway binary not found or not executable: $GW"; echo "0 passed, 1 failed"; exit 2; fi
fi

ADDR=127.0.0.1
RDMA_ADDR=10.0.2.15  # the guest's eth0, where Soft-RoCE (rxe0) runs for step r
RXE_OK=0
PORT=${E2E_PORT:-4420}
NPORT=$((PORT + 1))  # the negotiation cases' target
NQN=nqn.2016-06.io.ceph-nvmeof-rs:auth
OPEN_NQN=nqn.2016-06.io.ceph-nvmeof-rs:open
U=nqn.2014-08.org.nvmexpress:uuid:
# host IDs (each host NQN its own: the kernel refuses one host ID under two NQNs)
ID_MAIN=a0000000-0000-4000-8000-000000000001   # key + ctrl key
ID_UNI=a0000000-0000-4000-8000-000000000002    # key only (no ctrl key)
ID_NEG=a0000000-0000-4000-8000-000000000003    # the negotiation cases
ID_OPEN=a0000000-0000-4000-8000-000000000004   # kernel target only: nvmet keys are per host
ID_T=(a0000000-0000-4000-8000-000000000010 a0000000-0000-4000-8000-000000000011
      a0000000-0000-4000-8000-000000000012 a0000000-0000-4000-8000-000000000013)
H_MAIN=$U$ID_MAIN H_UNI=$U$ID_UNI H_NEG=$U$ID_NEG
H_T=("$U${ID_T[0]}" "$U${ID_T[1]}" "$U${ID_T[2]}" "$U${ID_T[3]}")
# the host allowed without a key in ...:open: the main host itself for our gateway (keys are
# per subsystem there); for nvmet, whose keys belong to the host, a host without one
if [ "$MODE" = gateway ]; then H_OPEN=$H_MAIN ID_OPEN=$ID_MAIN; else H_OPEN=$U$ID_OPEN; fi
NS_BYTES=$((64 * 1024 * 1024))
# the defaults of [gateway] dhchap_hashes / dhchap_dhgroups: what a host offering everything
# (Linux offers sha256/384/512 and null + all ffdhe groups) gets
DEF_HASH=sha512 DEF_DHGROUP=ffdhe2048
NEG_CASES=("sha256 null" "sha384 ffdhe2048" "sha512 ffdhe3072" "sha256 ffdhe4096" "sha384 ffdhe6144" "sha512 ffdhe8192")
export RUST_LOG=${RUST_LOG:-info}
export NO_COLOR=1

WORK=/tmp/e2e-auth
rm -rf $WORK; mkdir -p $WORK
CONF=$WORK/gateway.toml
GWLOG=$WORK/gateway.log
NGWLOG=""  # the current negotiation gateway's log
: > "$GWLOG"
GWPID="" NGWPID=""
SKIPPED=0

. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh"
guest_log_dir e2e-auth

on_step_failure() {
  gwlog_tail 12
  [ -n "$NGWLOG" ] && [ -s "$NGWLOG" ] && { echo "    --- negotiation gateway log ($NGWLOG) ---"; tail -n 8 "$NGWLOG" | sed 's/^/    | /'; }
  dmesg | grep -E 'nvme' | tail -n 8 | sed 's/^/    dmesg: /'
}
# a check of our gateway's own behaviour, not possible against nvmet: not a failure
skip_gw() { say "SKIP (--kernel-target): $*"; SKIPPED=$((SKIPPED + 1)); }
skip_list() { local r=$1 s; shift; for s in "$@"; do skip "$s" "$r"; done; }

# -------------------------------------------------------------- markers --
DMESG_N=0 LOG_N=0
mark() { DMESG_N=$(dmesg | wc -l); [ -s "${1:-$GWLOG}" ] && LOG_N=$(wc -l < "${1:-$GWLOG}") || LOG_N=0; }
new_dmesg() { dmesg | tail -n +$((DMESG_N + 1)); }
new_log() { tail -n +$((LOG_N + 1)) "${1:-$GWLOG}" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g'; }
# the value of field NAME in a tracing line (name=value or name="value"; the last one: the
# event's fields come after its spans'); no exec (each costs ~0.1 s under TCG)
field() { case $2 in *[\ ,\{]"$1"=*) ;; *) return 0 ;; esac; local v=${2##*[ ,{]"$1"=}; v=${v#\"}; echo "${v%%[\" ,\}]*}"; }

# ------------------------------------------------------------------ keys --
K_MAIN="" C_MAIN="" K_BAD="" C_BAD="" K_UNI="" K_NEG="" C_NEG="" K_OPEN=""
K_T=() C_T=()
gen() { # nqn [gen-dhchap-key options]: a key, checked for its format
  local k
  k=$(nvme gen-dhchap-key -n "$@" 2>&1) || { say "nvme gen-dhchap-key -n $*: $k"; return 1; }
  [[ $k =~ ^DHHC-1:0[0-3]:[A-Za-z0-9+/]+=*:$ ]] || { say "nvme gen-dhchap-key -n $* printed '$k'"; return 1; }
  echo "$k"
}
key_len() { # the secret's length in bytes (base64 of secret + CRC-32)
  local b=${1#DHHC-1:??:}; b=${b%:}
  echo $(( $(printf '%s' "$b" | base64 -d 2>/dev/null | wc -c) - 4 ))
}
gen_keys() {
  K_MAIN=$(gen "$H_MAIN") && C_MAIN=$(gen "$NQN") && K_BAD=$(gen "$H_MAIN") && C_BAD=$(gen "$NQN") &&
    K_UNI=$(gen "$H_UNI") && K_NEG=$(gen "$H_NEG" --hmac=1) && C_NEG=$(gen "$NQN" --hmac=1) &&
    K_OPEN=$(gen "$H_OPEN") || return 1
  local i want=(48 32 48 64) l  # --hmac=0 with a 48-byte key; 1/2/3 force 32/48/64
  for i in 0 1 2 3; do
    if [ $i = 0 ]; then K_T[0]=$(gen "${H_T[0]}" --hmac=0 -l 48) && C_T[0]=$(gen "$NQN" --hmac=0 -l 48) || return 1
    else K_T[i]=$(gen "${H_T[i]}" --hmac=$i) && C_T[i]=$(gen "$NQN" --hmac=$i) || return 1; fi
    [[ ${K_T[i]} == DHHC-1:0$i:* ]] && [[ ${C_T[i]} == DHHC-1:0$i:* ]] || { say "--hmac=$i key not DHHC-1:0$i: ${K_T[i]}"; return 1; }
    l=$(key_len "${K_T[i]}")
    say "--hmac=$i: ${K_T[i]:0:14}... ($l-byte secret)"
    [ "$l" = "${want[i]}" ] || { say "expected a ${want[i]}-byte secret"; return 1; }
  done
  { echo "main $H_MAIN key $K_MAIN ctrl $C_MAIN"; echo "wrong host key $K_BAD, wrong ctrl key $C_BAD"
    echo "uni $H_UNI key $K_UNI"; echo "neg $H_NEG key $K_NEG ctrl $C_NEG"; echo "open $H_OPEN key $K_OPEN"
    for i in 0 1 2 3; do echo "hmac-$i ${H_T[i]} key ${K_T[i]} ctrl ${C_T[i]}"; done; } > "$LOGDIR/keys.txt"
}

# ---------------------------------------------------------------- kernel --
auth_kernel_check() { # NVMe auth in the guest kernel: host side always, target side for --kernel-target
  local cfg=${RVM_KERNEL_CONFIG:-/boot/config-$(uname -r)} host=0 target=1 h
  [ -r "$cfg" ] && say "$(grep -E '^(# )?CONFIG_NVME_(AUTH|HOST_AUTH|TARGET_AUTH)[ =]' "$cfg" | tr '\n' ' ')"
  # nvme_auth_negotiate is nvme-core's (CONFIG_NVME_HOST_AUTH, before 6.7 CONFIG_NVME_AUTH)
  grep -qw nvme_auth_negotiate /proc/kallsyms && host=1
  if [ "$MODE" = kernel ]; then
    target=0 h=/sys/kernel/config/nvmet/hosts/e2e-auth-probe
    mkdir $h 2>/dev/null && { [ -e $h/dhchap_key ] && target=1; rmdir $h; }
  fi
  say "host DH-HMAC-CHAP: $([ $host = 1 ] && echo yes || echo NO)$([ "$MODE" = kernel ] && echo ", nvmet DH-HMAC-CHAP: $([ $target = 1 ] && echo yes || echo NO)")"
  [ $host = 1 ] && [ $target = 1 ] && return 0
  say "guest kernel $(uname -r) has no NVMe in-band authentication (CONFIG_NVME_HOST_AUTH$([ "$MODE" = kernel ] && echo ' / CONFIG_NVME_TARGET_AUTH')):"
  say "boot Debian's bookworm-backports kernel: eval \"\$(tests/vm/get-bpo-kernel.sh)\" before run-in-vm.sh"
  return 1
}

# ---------------------------------------------------------------- target --
host_entry() { # nqn key [ctrl key]: a hosts[] table
  printf '  { nqn = "%s", dhchap_key = "%s"%s },\n' "$1" "$2" "${3:+, dhchap_ctrl_key = \"$3\"}"
}
write_config() { # file port mode(main|neg) [hash dhgroup]
  local i
  {
    [ "$3" = neg ] && printf '[gateway]\ndhchap_hashes = ["%s"]\ndhchap_dhgroups = ["%s"]\n\n' "$4" "$5"
    printf '[[listener]]\ntransport = "tcp"\naddress = "%s"\nport = %s\n\n' "$ADDR" "$2"
    [ "$3" = main ] && [ "$RXE_OK" = 1 ] && printf '[[listener]]\ntransport = "rdma"\naddress = "%s"\nport = %s\n\n' "$RDMA_ADDR" "$2"
    printf '[[subsystem]]\nnqn = "%s"\nallow_any_host = false\nhosts = [\n' "$NQN"
    if [ "$3" = main ]; then
      host_entry "$H_MAIN" "$K_MAIN" "$C_MAIN"
      host_entry "$H_UNI" "$K_UNI"
      for i in 0 1 2 3; do host_entry "${H_T[i]}" "${K_T[i]}" "${C_T[i]}"; done
    else
      host_entry "$H_NEG" "$K_NEG" "$C_NEG"
    fi
    printf ']\n\n[[subsystem.namespace]]\nnsid = 1\nbackend = "memory"\nsize = "64MiB"\n'
    if [ "$3" = main ]; then
      printf '\n[[subsystem]]\nnqn = "%s"\nallow_any_host = false\nhosts = ["%s"]\n\n' "$OPEN_NQN" "$H_OPEN"
      printf '[[subsystem.namespace]]\nnsid = 1\nbackend = "memory"\nsize = "64MiB"\n'
    fi
  } > "$1"
  cp "$1" "$LOGDIR/" 2>/dev/null
}
gw_alive() { [ "$MODE" = kernel ] && return 0; [ -n "$GWPID" ] && kill -0 "$GWPID" 2>/dev/null; }

CFG=/sys/kernel/config/nvmet
nvmet_host() { # nqn key ctrl-key(or "") hash dhgroup: a host with its DH-HMAC-CHAP settings
  local h=$CFG/hosts/$1
  mkdir -p $h || return 1
  [ -n "$2" ] && { echo "$2" > $h/dhchap_key || return 1; }
  [ -n "$3" ] && { echo "$3" > $h/dhchap_ctrl_key || return 1; }
  [ -n "${4:-}" ] && { echo "hmac($4)" > $h/dhchap_hash && echo "$5" > $h/dhchap_dhgroup || return 1; }
  return 0
}
nvmet_subsys() { # nqn dev hosts...
  local s=$CFG/subsystems/$1 dev=$2 h; shift 2
  mkdir $s && echo 0 > $s/attr_allow_any_host || return 1
  for h in "$@"; do ln -s $CFG/hosts/$h $s/allowed_hosts/ || return 1; done
  mkdir $s/namespaces/1 && echo -n $dev > $s/namespaces/1/device_path && echo 1 > $s/namespaces/1/enable
}
nvmet_port() { # id port subsystems...
  local p=$CFG/ports/$1 n; mkdir $p && echo tcp > $p/addr_trtype && echo ipv4 > $p/addr_adrfam &&
    echo $ADDR > $p/addr_traddr && echo "$2" > $p/addr_trsvcid || return 1
  shift 2
  for n in "$@"; do ln -s $CFG/subsystems/$n $p/subsystems/$n || return 1; done
}
kernel_start() { # nvmet: the same subsystems, hosts and keys; hash/dhgroup = the gateway's defaults
  local i
  say "kernel nvmet target (--kernel-target), not our binary; each keyed host: hmac($DEF_HASH), $DEF_DHGROUP"
  nullb authns && nullb openns || return 1
  nvmet_host "$H_MAIN" "$K_MAIN" "$C_MAIN" $DEF_HASH $DEF_DHGROUP && nvmet_host "$H_UNI" "$K_UNI" "" $DEF_HASH $DEF_DHGROUP &&
    nvmet_host "$H_NEG" "$K_NEG" "$C_NEG" $DEF_HASH $DEF_DHGROUP && nvmet_host "$H_OPEN" "" "" || return 1
  for i in 0 1 2 3; do nvmet_host "${H_T[i]}" "${K_T[i]}" "${C_T[i]}" $DEF_HASH $DEF_DHGROUP || return 1; done
  nvmet_subsys $NQN /dev/authns "$H_MAIN" "$H_UNI" "$H_NEG" "${H_T[@]}" && nvmet_subsys $OPEN_NQN /dev/openns "$H_OPEN" &&
    nvmet_port 1 "$PORT" $NQN $OPEN_NQN && nvmet_port 2 "$NPORT" $NQN || return 1
  port_listening "$PORT" && port_listening "$NPORT" || { say "nvmet does not listen on $PORT and $NPORT"; return 1; }
  say "listening on $ADDR:$PORT (both subsystems) and $ADDR:$NPORT ($NQN)"
}
kernel_stop() { # everything kernel_start made, in reverse
  local p s h n
  for p in $CFG/ports/*; do [ -d "$p" ] || continue; rm -f "$p"/subsystems/*; rmdir "$p" || return 1; done
  for s in $CFG/subsystems/*; do
    [ -d "$s" ] || continue
    echo 0 > "$s/namespaces/1/enable"; rmdir "$s/namespaces/1"; rm -f "$s"/allowed_hosts/*; rmdir "$s" || return 1
  done
  for h in $CFG/hosts/*; do [ -d "$h" ] && { rmdir "$h" || return 1; }; done
  for n in authns openns; do [ -d /sys/kernel/config/nullb/$n ] && rmdir /sys/kernel/config/nullb/$n; done
  return 0
}
start_target() {
  if [ "$MODE" = kernel ]; then kernel_start; return; fi
  write_config "$CONF" "$PORT" main
  run_gateway "$CONF" "$GWLOG" "$PORT" || return 1
  GWPID=$STARTED_PID
}
stop_target() { # SIGTERM: exit 0 within 10 s
  if [ "$MODE" = kernel ]; then kernel_stop || { say "nvmet teardown failed"; return 1; }; say "nvmet torn down"; return 0; fi
  sigterm_gateway || return 1
  port_listening "$PORT" && { say "port $PORT still listening after exit"; return 1; }
  [ "$GW_STATUS" -eq 0 ]
}

# ------------------------------------------------------------- initiator --
CTRL="" NIOQ=0 DEV=""
# connect SUBNQN PORT HOSTNQN HOSTID [nvme connect options]: sets CTRL, NIOQ (its I/O queues)
# and DEV; the dmesg and gateway-log markers are set just before (mark)
connect() {
  local sub=$1 port=$2 h=$3 hid=$4 out rc; shift 4
  mark "${AUTH_LOG:-$GWLOG}"
  out=$(timeout -k 5 90 nvme connect -t "${CONN_T:-tcp}" -a "${CONN_A:-$ADDR}" -s "$port" --ctrl-loss-tmo=5 --reconnect-delay=1 \
          -n "$sub" --hostnqn="$h" --hostid="$hid" "$@" 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  if [ $rc -ne 0 ]; then
    say "nvme connect -n $sub --hostnqn=$h $(opts_brief "$@") failed (rc=$rc)"
    new_dmesg | grep -E 'nvme' | tail -n 6 | sed 's/^/    dmesg: /'
    return 1
  fi
  CTRL=$(host_ctrl "$sub" "$h" "$port") || { say "connected, but no controller of $sub for $h in sysfs"; return 1; }
  NIOQ=$(new_dmesg | sed -n "s/.*nvme $CTRL: creating \([0-9]*\) I\/O queues.*/\1/p" | tail -n 1)
  DEV=$(NQN=$sub ns_dev) || { say "connected ($CTRL), but no namespace block device of $sub within 15 s"; DEV=""; return 1; }
  local sz=$(( $(cat /sys/block/${DEV#/dev/}/size) * 512 ))
  say "$CTRL (cntlid $(cat /sys/class/nvme/$CTRL/cntlid), ${NIOQ:-?} I/O queues) -> $DEV, $sz bytes"
  [ -n "$NIOQ" ] || { say "no 'creating N I/O queues' line for $CTRL in dmesg"; return 1; }
  [ "$sz" = $NS_BYTES ] || { say "namespace size $sz, expected $NS_BYTES"; return 1; }
}
opts_brief() { local a o=""; for a in "$@"; do o+="${a%%=DHHC-1:*}$([[ $a == *=DHHC-1:* ]] && echo '=<key>') "; done; echo "${o% }"; }
disconnect() { # the controller CTRL
  [ -n "$CTRL" ] && [ -e /sys/class/nvme/$CTRL ] || { CTRL=""; return 0; }
  timeout -k 5 60 nvme disconnect -d "$CTRL" > /dev/null 2>&1
  for _ in $(seq 150); do [ -e /sys/class/nvme/$CTRL ] || { CTRL=""; return 0; }; sleep 0.1; done
  say "$CTRL still present 15 s after nvme disconnect"; return 1
}
fio_small() { # label size
  fio_run "$1" --rw=randwrite --bs=4k --size="$2" --iodepth=16
}

# what the host says about the admin queue's authentication (dmesg since mark)
host_auth_check() { # hash dhgroup bidirectional(true|false)
  local new; new=$(new_dmesg | grep "nvme $CTRL: ")
  echo "$new" | grep -E 'auth' | sed 's/^/    dmesg: /'
  echo "$new" | grep -q "nvme $CTRL: qid 0: authenticated with hash hmac($1) dhgroup $2\$" ||
    { say "the host did not log 'qid 0: authenticated with hash hmac($1) dhgroup $2'"; return 1; }
  if [ "$3" = true ]; then
    echo "$new" | grep -q "nvme $CTRL: qid 0: controller authenticated" ||
      { say "the host did not authenticate the controller ('qid 0: controller authenticated')"; return 1; }
  else
    echo "$new" | grep -q "controller authenticated" && { say "the host authenticated the controller in a unidirectional connect"; return 1; }
  fi
  echo "$new" | grep -q 'authentication failed' && { say "the host logged an authentication failure"; return 1; }
  return 0
}
# our gateway's "queue authenticated" lines (log since mark) for CTRL: qid 0..NIOQ, each once
# at least, with the hash, DH group and direction expected
gw_auth_check() { # hash dhgroup bidirectional [log]
  if [ "$MODE" = kernel ]; then skip_gw "gateway 'queue authenticated' lines (hash=$1 dhgroup=$2 bidirectional=$3)"; return 0; fi
  local log=${4:-$GWLOG} cid lines l q qids missing="" bad=0 h
  cid=$(( $(cat /sys/class/nvme/$CTRL/cntlid) ))
  h=$(cat /sys/class/nvme/$CTRL/hostnqn)
  for _ in $(seq 50); do  # the gateway may log just after the host's connect returned
    lines="" qids=" "
    while IFS= read -r l; do
      [ "$(field cntlid "$l")" = "$cid" ] || continue
      lines+="$l"$'\n' qids+="$(field qid "$l") "
    done < <(new_log "$log" | grep 'queue authenticated')
    lines=${lines%$'\n'} missing=""
    for q in $(seq 0 "$NIOQ"); do [[ $qids == *" $q "* ]] || missing+=" $q"; done
    [ -z "$missing" ] && break
    sleep 0.1
  done
  [ -n "$lines" ] && echo "$lines" | sed 's/^/    gw: /'
  [ -z "$missing" ] || { say "no gateway 'queue authenticated' line for cntlid $cid qid$missing"; return 1; }
  while IFS= read -r l; do
    [ "$(field host "$l")" = "$h" ] || { say "host= is not $h: $l"; bad=1; }
    [ "$(field hash "$l")" = "$1" ] || { say "hash= is not $1"; bad=1; }
    [ "$(field dhgroup "$l")" = "$2" ] || { say "dhgroup= is not $2"; bad=1; }
    [ "$(field bidirectional "$l")" = "$3" ] || { say "bidirectional= is not $3"; bad=1; }
  done <<< "$lines"
  [ $bad = 0 ] && say "gateway: cntlid $cid qid 0..$NIOQ authenticated, hash=$1 dhgroup=$2 bidirectional=$3"
  [ $bad = 0 ]
}

# ----------------------------------------------------------------- steps --
a_connect() {
  connect $NQN "$PORT" "$H_MAIN" $ID_MAIN --dhchap-secret="$K_MAIN" || return 1
  host_auth_check $DEF_HASH $DEF_DHGROUP false || return 1
  gw_auth_check $DEF_HASH $DEF_DHGROUP false
}
a_list() { # nvme list-subsys and sysfs show the authenticated controller
  local st sec csec out
  out=$(timeout -k 5 30 nvme list-subsys -o json 2>&1) || { say "nvme list-subsys failed: $out"; return 1; }
  echo "$out" > "$LOGDIR/list-subsys.json"
  echo "$out" | python3 -c '
import json, sys
nqn, ctrl, port = sys.argv[1:4]
d = json.load(sys.stdin)
for h in (d if isinstance(d, list) else [d]):
    for s in h.get("Subsystems", []):
        if s.get("NQN") != nqn:
            continue
        for p in s.get("Paths", []):
            print("    list-subsys: %s %s %s %s %s (host %s)" % (s.get("Name"), p.get("Name"), p.get("Transport"), p.get("Address"), p.get("State"), h.get("HostNQN")))
            if p.get("Name") == ctrl and p.get("Transport") == "tcp" and "trsvcid=%s" % port in p.get("Address", "") and p.get("State") == "live":
                sys.exit(0)
print("    nvme list-subsys does not list %s with a live tcp path %s on port %s" % (nqn, ctrl, port))
sys.exit(1)' "$NQN" "$CTRL" "$PORT" || return 1
  st=$(cat /sys/class/nvme/$CTRL/state) sec=$(cat /sys/class/nvme/$CTRL/dhchap_secret 2>/dev/null) csec=$(cat /sys/class/nvme/$CTRL/dhchap_ctrl_secret 2>/dev/null)
  say "sysfs $CTRL: state=$st dhchap_secret=${sec:0:14}... dhchap_ctrl_secret=$csec"
  [ "$st" = live ] || { say "state is not live"; return 1; }
  [ "$sec" = "$K_MAIN" ] || { say "dhchap_secret is not the key connected with"; return 1; }
  [ "$csec" = none ] || { say "dhchap_ctrl_secret is not 'none' for a unidirectional connect"; return 1; }
}
b_connect() {
  connect $NQN "$PORT" "$H_MAIN" $ID_MAIN --dhchap-secret="$K_MAIN" --dhchap-ctrl-secret="$C_MAIN" || return 1
  host_auth_check $DEF_HASH $DEF_DHGROUP true || return 1
  gw_auth_check $DEF_HASH $DEF_DHGROUP true
}
rxe_setup() { # Soft-RoCE on eth0 for the RDMA step (the gateway's rdma listener waits for it)
  modprobe -a ib_uverbs rdma_ucm nvme-rdma rdma_rxe || return 1
  rdma link add rxe0 type rxe netdev eth0 || return 1
  for _ in $(seq 50); do rdma link show rxe0/1 2>/dev/null | grep -q ACTIVE && { RXE_OK=1; return 0; }; sleep 0.1; done
  say "rxe0 port not ACTIVE"; return 1
}
rdma_check() { # bidirectional over nvme-rdma: the transaction rides keyed SGLs / RDMA READ and WRITE
  if [ "$MODE" = kernel ]; then skip_gw "nvme-rdma (the kernel target serves TCP only here)"; return 0; fi
  [ "$RXE_OK" = 1 ] || { say "no rxe device (step setup.rxe failed)"; return 1; }
  rdma_listener_ready || return 1
  CONN_T=rdma CONN_A=$RDMA_ADDR connect $NQN "$PORT" "$H_MAIN" $ID_MAIN --dhchap-secret="$K_MAIN" --dhchap-ctrl-secret="$C_MAIN" || return 1
  [ "$(cat /sys/class/nvme/$CTRL/transport)" = rdma ] || { say "$CTRL is not an rdma controller"; disconnect; return 1; }
  host_auth_check $DEF_HASH $DEF_DHGROUP true || { disconnect; return 1; }
  gw_auth_check $DEF_HASH $DEF_DHGROUP true || { disconnect; return 1; }
  fio_small rdma-4k 8M || { disconnect; return 1; }
  disconnect
}
rdma_listener_ready() { # the gateway's rdma listener is up (it retries every second until rxe0 is)
  for _ in $(seq 150); do
    grep -q "NVMe/RDMA listener ready addr=$RDMA_ADDR:$PORT" "$GWLOG" && return 0
    sleep 0.1
  done
  say "the gateway log has no 'NVMe/RDMA listener ready addr=$RDMA_ADDR:$PORT' after 15 s"; return 1
}
FAILURE2_RUNS=${FAILURE2_RUNS:-20} FAILURE2_BOUND=${FAILURE2_BOUND:-30}
rdma_failure2_repeat() { # a wrong ctrl key over nvme-rdma, repeated: every connect fails quickly
  if [ "$MODE" = kernel ]; then skip_gw "nvme-rdma (the kernel target serves TCP only here)"; return 0; fi
  [ "$RXE_OK" = 1 ] || { say "no rxe device (step setup.rxe failed)"; return 1; }
  rdma_listener_ready || return 1
  local i rc t0 ms out new hung=0 wrong=0 slowest=0 times="" n=0
  for i in $(seq "$FAILURE2_RUNS"); do
    # a hang costs minutes (the host times the command out after 60 s, more than once):
    # stop at the first unless measuring the rate
    [ $hung -gt 0 ] && [ "${FAILURE2_KEEP_GOING:-0}" != 1 ] && { say "stopping after the first hang (FAILURE2_KEEP_GOING=1 runs them all)"; break; }
    n=$i
    mark
    t0=$(date +%s%N)
    out=$(timeout -k 5 "$FAILURE2_BOUND" nvme connect -t rdma -a $RDMA_ADDR -s "$PORT" --ctrl-loss-tmo=5 --reconnect-delay=1 \
            -n $NQN --hostnqn="$H_MAIN" --hostid=$ID_MAIN --dhchap-secret="$K_MAIN" --dhchap-ctrl-secret="$C_BAD" 2>&1)
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    times+=" $ms" && [ $ms -gt $slowest ] && slowest=$ms
    new=$(new_dmesg | grep -E 'nvme')
    if [ $rc -eq 0 ] || CTRL=$(host_ctrl $NQN "$H_MAIN" "$PORT"); then
      say "attempt $i: UNEXPECTED: the connect succeeded"; disconnect; wrong=$((wrong + 1)); continue
    fi
    if [ $rc -eq 124 ] || [ $ms -ge $((FAILURE2_BOUND * 1000)) ]; then
      hung=$((hung + 1))
      say "attempt $i: HUNG: nvme connect had not failed after ${ms} ms (rc=$rc)"
      echo "$new" | tail -n 6 | sed 's/^/    dmesg: /'
    elif ! echo "$new" | grep -q 'qid 0: controller authentication failed'; then
      wrong=$((wrong + 1))
      say "attempt $i: failed in ${ms} ms (rc=$rc) without 'controller authentication failed':"
      { echo "$out"; echo "$new"; } | tail -n 6 | sed 's/^/    /'
    fi
    # a hung attempt may leave the host reconnecting: wait until it gave the controller up
    for _ in $(seq 100); do host_ctrl $NQN "$H_MAIN" "$PORT" > /dev/null || break; sleep 0.1; done
  done
  say "Failure2 over nvme-rdma: $n attempts, $hung hung (>= ${FAILURE2_BOUND} s), $wrong other failures; slowest ${slowest} ms; each (ms):$times"
  gw_alive || { say "the gateway DIED (pid $GWPID)"; return 1; }
  local waited; waited=$(sed 's/\x1b\[[0-9;]*m//g' "$GWLOG" | grep -c 'sends still not completed when closing')
  [ "$waited" -gt 0 ] && say "gateway: $waited close(s) gave up waiting for their send completions"
  [ $hung -eq 0 ] && [ $wrong -eq 0 ]
}
DD=/proc/dynamic_debug/control
reauth_check() { # the same secret again: the host re-authenticates every queue of the live controller
  local n0 n1 new q missing st dd=0
  [ -n "$CTRL" ] && [ -e /sys/class/nvme/$CTRL ] || { say "no connected controller"; return 1; }
  n0=$(sed 's/\x1b\[[0-9;]*m//g' "$GWLOG" | grep -c 'queue authenticated')
  mark
  # the host's per-queue steps (debug level): "qid N send success2" = the controller's
  # response checked (bidirectional), for the admin queue and each I/O queue
  [ -w $DD ] && echo 'func nvme_queue_auth_work +p' 2>/dev/null > $DD && dd=1
  printf '%s' "$K_MAIN" > /sys/class/nvme/$CTRL/dhchap_secret || { say "writing $CTRL/dhchap_secret failed"; return 1; }
  for _ in $(seq 300); do  # up to 30 s
    new=$(new_dmesg | grep "nvme $CTRL: ")
    missing=""
    for q in $(seq 0 "$NIOQ"); do echo "$new" | grep -q "qid $q send success2" || missing+=" $q"; done
    [ -z "$missing" ] && break
    echo "$new" | grep -q 'authentication failed' && break
    sleep 0.1
  done
  [ $dd = 1 ] && echo 'func nvme_queue_auth_work -p' > $DD
  echo "$new" | grep -vE 'nvme_queue_auth_work: qid [0-9]+ (send negotiate|receive challenge|DH exponential|host response|send reply|receive success1|controller response)' | sed 's/^/    dmesg: /'
  echo "$new" | grep -q 're-authenticating controller' || { say "the host did not start re-authentication"; return 1; }
  echo "$new" | grep -q "qid 0: authenticated with hash hmac($DEF_HASH) dhgroup $DEF_DHGROUP" ||
    { say "no new 'qid 0: authenticated with hash hmac($DEF_HASH) dhgroup $DEF_DHGROUP'"; return 1; }
  echo "$new" | grep -q 'authentication failed' && { say "re-authentication failed on the host"; return 1; }
  if [ $dd = 1 ]; then
    [ -z "$missing" ] || { say "no 'send success2' (re-authentication done) for qid$missing within 30 s"; return 1; }
    say "the host re-authenticated qid 0..$NIOQ (each sent success2)"
  else
    say "no dynamic debug for nvme_queue_auth_work ($DD): per-queue re-authentication not visible on the host"
  fi
  if [ "$MODE" = gateway ]; then
    for _ in $(seq 50); do
      n1=$(sed 's/\x1b\[[0-9;]*m//g' "$GWLOG" | grep -c 'queue authenticated')
      [ "$n1" -ge $((n0 + NIOQ + 1)) ] && break; sleep 0.1
    done
    say "gateway 'queue authenticated' lines: $n0 before, $n1 after (+$((NIOQ + 1)) expected)"
    [ "$n1" -ge $((n0 + NIOQ + 1)) ] || { say "the gateway did not log the re-authentication of every queue"; return 1; }
  else
    skip_gw "gateway 'queue authenticated' count after re-authentication"
  fi
  st=$(cat /sys/class/nvme/$CTRL/state)
  [ "$st" = live ] || { say "$CTRL state $st after re-authentication"; return 1; }
  fio_small reauth-4k 4M
}
# a connect that must fail with the host saying WANT (dmesg); the gateway stays alive
expect_fail() { # want-regex gw-reason(1: the gateway must log "authentication failed ... reason=") connect-args...
  local expect=$1 gwreason=$2 out rc new host sub; shift 2
  sub=$1 host=$3
  mark
  out=$(timeout -k 5 90 nvme connect -t tcp -a $ADDR -s "$2" --ctrl-loss-tmo=5 --reconnect-delay=1 \
          -n "$1" --hostnqn="$3" --hostid="$4" "${@:5}" 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  new=$(new_dmesg | grep -E 'nvme')
  echo "$new" | grep -vE 'nvmet' | tail -n 5 | sed 's/^/    dmesg: /'
  if [ $rc -eq 0 ] || host_ctrl "$sub" "$host" "$2" > /dev/null; then
    say "UNEXPECTED: connect as $host ($(opts_brief "${@:5}")) succeeded"
    CTRL=$(host_ctrl "$sub" "$host" "$2") && disconnect
    return 1
  fi
  [ $rc -eq 124 ] && { say "nvme connect hung until the timeout instead of failing"; return 1; }
  echo "$new" | grep -qE "$expect" || { say "connect failed, but the host did not log '$expect'"; return 1; }
  say "refused as expected: $(echo "$new" | grep -oE "$expect.*" | head -n 1)"
  sleep 0.5
  gw_alive || { say "the gateway DIED (pid $GWPID)"; return 1; }
  [ "$MODE" = gateway ] && say "gateway alive (pid $GWPID)"
  if [ "$MODE" = gateway ]; then
    local gl; gl=$(new_log)
    echo "$gl" | grep -E 'authentication failed|queue authenticated' | sed 's/^/    gw: /'
    echo "$gl" | grep 'queue authenticated' | grep -qF "$host" && { say "the gateway logged 'queue authenticated' for $host"; return 1; }
    if [ "$gwreason" = 1 ]; then
      echo "$gl" | grep 'authentication failed' | grep -q 'reason=' || { say "no gateway 'authentication failed ... reason=' line"; return 1; }
    fi
  elif [ "$gwreason" = 1 ]; then
    skip_gw "gateway 'authentication failed ... reason=' line"
  fi
  return 0
}
good_after() { # the gateway still serves a good host: connect, read, disconnect
  connect $NQN "$PORT" "$H_MAIN" $ID_MAIN --dhchap-secret="$K_MAIN" -i 1 || return 1
  host_auth_check $DEF_HASH $DEF_DHGROUP false || { disconnect; return 1; }
  timeout -k 5 60 dd if="$DEV" of=/dev/null bs=64k count=16 iflag=direct 2>/dev/null || { say "read failed"; disconnect; return 1; }
  say "read 1 MiB"
  disconnect
}
transform_check() { # i: keys made with --hmac=i, bidirectional
  connect $NQN "$PORT" "${H_T[$1]}" "${ID_T[$1]}" --dhchap-secret="${K_T[$1]}" --dhchap-ctrl-secret="${C_T[$1]}" -i 1 || return 1
  local rc=0
  host_auth_check $DEF_HASH $DEF_DHGROUP true && gw_auth_check $DEF_HASH $DEF_DHGROUP true || rc=1
  disconnect || rc=1
  return $rc
}
neg_check() { # hash dhgroup: the target restricted to them, the host offering everything
  local rc=0 cfg=$WORK/gateway-$1-$2.toml
  if [ "$MODE" = gateway ]; then
    NGWLOG=$WORK/gateway-$1-$2.log; : > "$NGWLOG"
    write_config "$cfg" "$NPORT" neg "$1" "$2"
    run_gateway "$cfg" "$NGWLOG" "$NPORT" || { cp "$NGWLOG" "$LOGDIR/"; return 1; }
    NGWPID=$STARTED_PID
  else
    say "nvmet host $H_NEG: dhchap_hash hmac($1), dhchap_dhgroup $2"
    echo "hmac($1)" > $CFG/hosts/$H_NEG/dhchap_hash && echo "$2" > $CFG/hosts/$H_NEG/dhchap_dhgroup || return 1
  fi
  AUTH_LOG=$NGWLOG
  # A keep-alive timeout of 30 s, not the default 5: the controller's keep-alive timer runs
  # from Connect (as in nvmet), and under TCG emulation on a loaded machine the host's own
  # ffdhe8192 exponentiations take over 10 s between the challenge and its reply (a real CPU
  # takes milliseconds), so the default once expired mid-transaction.
  if connect $NQN "$NPORT" "$H_NEG" $ID_NEG --dhchap-secret="$K_NEG" --dhchap-ctrl-secret="$C_NEG" -i 1 --keep-alive-tmo=30; then
    host_auth_check "$1" "$2" true && gw_auth_check "$1" "$2" true "$NGWLOG" || rc=1
    timeout -k 5 60 dd if="$DEV" of=/dev/null bs=64k count=4 iflag=direct 2>/dev/null || { say "read failed"; rc=1; }
    disconnect || rc=1
  else
    rc=1
  fi
  AUTH_LOG=""
  if [ "$MODE" = gateway ]; then
    local keep=$GWPID
    GWPID=$NGWPID; sigterm_gateway || rc=1; GWPID=$keep NGWPID=""
    [ "${GW_STATUS:-1}" = 0 ] || { say "negotiation gateway exit status ${GW_STATUS:-?}"; rc=1; }
    cp "$NGWLOG" "$LOGDIR/"
  fi
  return $rc
}
open_check() { # no ATR for a host allowed without a key: no authentication despite --dhchap-secret
  local n0 n1 new
  n0=$(sed 's/\x1b\[[0-9;]*m//g' "$GWLOG" | grep -c 'queue authenticated')
  connect $OPEN_NQN "$PORT" "$H_OPEN" $ID_OPEN --dhchap-secret="$K_OPEN" || return 1
  new=$(new_dmesg | grep "nvme $CTRL: ")
  echo "$new" | grep -E 'auth' | sed 's/^/    dmesg: /'
  echo "$new" | grep -qE 'authenticated|authentication' &&
    { say "the host authenticated: the target asked for it (ATR in the Connect result)"; disconnect; return 1; }
  say "the host did not authenticate (no ATR), although it has --dhchap-secret"
  if [ "$MODE" = gateway ]; then
    n1=$(sed 's/\x1b\[[0-9;]*m//g' "$GWLOG" | grep -c 'queue authenticated')
    [ "$n1" = "$n0" ] || { say "gateway 'queue authenticated' lines went $n0 -> $n1"; disconnect; return 1; }
  fi
  fio_small open-4k 8M || { disconnect; return 1; }
  disconnect
}
# The DGST byte of every ICReq/ICResp on lo port PORT while it runs (until $WORK/cap.stop):
# byte 11 of both PDUs, bit 0 header digest, bit 1 data digest. Prints "ready", then one
# line per PDU: "icreq N" / "icresp N".
icpdu_capture() { # port
  python3 -c '
import os, socket, struct, sys, time
port, stop = int(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0800))
s.bind(("lo", 0)); s.settimeout(0.2)
print("ready", flush=True)
seen, end = set(), time.time() + 60
while time.time() < end and not os.path.exists(stop):
    try:
        pkt, addr = s.recvfrom(65535)
    except socket.timeout:
        continue
    if addr[2] == socket.PACKET_OUTGOING:  # lo shows each packet twice
        continue
    ip = pkt[14:]
    if len(ip) < 20 or ip[9] != 6:
        continue
    tcp = ip[(ip[0] & 15) * 4:]
    sp, dp, seq = struct.unpack("!HHI", tcp[:8])
    pl = tcp[(tcp[12] >> 4) * 4:]
    if port not in (sp, dp) or len(pl) < 128 or pl[0] not in (0, 1) or pl[2] != 128 or (sp, dp, seq) in seen:
        continue
    seen.add((sp, dp, seq))
    print("%s %d" % ("icreq" if pl[0] == 0 else "icresp", pl[11]), flush=True)
' "$1" "$WORK/cap.stop"
}
digest_check() {
  local cap=$WORK/icpdus.txt cpid n rc=0
  rm -f "$WORK/cap.stop"
  icpdu_capture "$PORT" > "$cap" 2>&1 &
  cpid=$!
  for _ in $(seq 100); do grep -q ready "$cap" && break; sleep 0.1; done
  connect $NQN "$PORT" "$H_MAIN" $ID_MAIN --dhchap-secret="$K_MAIN" --dhchap-ctrl-secret="$C_MAIN" --hdr-digest --data-digest || rc=1
  touch "$WORK/cap.stop"; wait $cpid
  [ $rc = 0 ] || return 1
  # every queue (admin + I/O) asked for both digests and the target granted both
  say "DGST bytes seen: $(grep -E '^icre' "$cap" | sort | uniq -c | awk '{printf "%s%s DGST=%s x%s", (NR > 1 ? ", " : ""), $2, $3, $1}')"
  n=$((NIOQ + 1))
  [ "$(grep -c '^icreq 3$' "$cap")" -ge $n ] && [ "$(grep -c '^icresp 3$' "$cap")" -ge $n ] &&
    ! grep -qE '^icre(q|sp) [^3]' "$cap" ||
    { say "expected $n ICReq and $n ICResp with DGST=3 (header+data digest): $(tr '\n' ' ' < "$cap")"; disconnect; return 1; }
  host_auth_check $DEF_HASH $DEF_DHGROUP true && gw_auth_check $DEF_HASH $DEF_DHGROUP true &&
    fio_small digest-4k 8M || { disconnect; return 1; }
  disconnect
}

# SIGHUP reload with a host connected to an untouched subsystem (...:open) running fio verify
# while the file gains a subsystem (...:added, for the uni host) and the main host's key on
# ...:auth changes (to K_BAD): the untouched controller never reconnects (same device, same
# cntlid, live, no new "creating N I/O queues" or reconnect lines in dmesg), fio verify
# passes, the added subsystem serves, the main host connects with its new key only.
ADDED_NQN=nqn.2016-06.io.ceph-nvmeof-rs:added
reload_check() {
  if [ "$MODE" = kernel ]; then skip_gw "SIGHUP reload (the kernel target is configured through configfs)"; return 0; fi
  local ctrl cntlid fpid frc=0 rc=0 new=$WORK/gateway-reloaded.toml line dm dm0
  connect $OPEN_NQN "$PORT" "$H_OPEN" $ID_OPEN || return 1
  ctrl=$CTRL cntlid=$(cat /sys/class/nvme/$CTRL/cntlid)
  # (fio_run's own fio: randwrite with crc32c verify, in the background meanwhile)
  fio_run reload-untouched --rw=randwrite --bs=4k --size=16M --iodepth=8 & fpid=$!
  sed "s|$K_MAIN|$K_BAD|" "$CONF" > "$new"
  printf '\n[[subsystem]]\nnqn = "%s"\nhosts = ["%s"]\n\n[[subsystem.namespace]]\nnsid = 1\nbackend = "memory"\nsize = "64MiB"\n' \
    "$ADDED_NQN" "$H_UNI" >> "$new"
  cp "$new" "$LOGDIR/" 2>/dev/null
  mv "$new" "$CONF"
  mark
  dm0=$DMESG_N  # (connect below marks again)
  kill -HUP "$GWPID"
  for _ in $(seq 200); do
    line=$(new_log | grep -E 'configuration reload(ed| refused)') && break
    sleep 0.1
  done
  echo "$line" | sed 's/^/    gw: /'
  new_log | grep -E 'subsystem served|keys changed' | sed 's/^/    gw: /'
  [[ $line == *"configuration reloaded"* ]] || { say "no 'configuration reloaded' in the gateway log after SIGHUP"; rc=1; }
  gw_alive || { say "the gateway died on SIGHUP"; return 1; }
  # the added subsystem serves; the key changed (in force from the next authentication)
  if [ $rc = 0 ]; then
    CTRL=""; connect $ADDED_NQN "$PORT" "$H_UNI" $ID_UNI && say "$ADDED_NQN serves" || { say "cannot connect to the added subsystem"; rc=1; }
    disconnect
    CTRL=""; connect $NQN "$PORT" "$H_MAIN" $ID_MAIN --dhchap-secret="$K_BAD" && say "$NQN: the main host connects with its new key" ||
      { say "the main host cannot connect with its new key"; rc=1; }
    disconnect
  fi
  wait $fpid || frc=1
  [ $frc = 0 ] && say "fio verify on the untouched subsystem passed through the reload" || { say "fio verify on $OPEN_NQN failed"; rc=1; }
  # the untouched controller: never reconnected
  if [ ! -e /sys/class/nvme/$ctrl ] || [ "$(cat /sys/class/nvme/$ctrl/cntlid)" != "$cntlid" ] ||
     [ "$(cat /sys/class/nvme/$ctrl/state)" != live ]; then
    say "$ctrl is not the same live controller (cntlid $cntlid) any more"; rc=1
  fi
  dm=$(dmesg | tail -n +$((dm0 + 1)) | grep -E "nvme $ctrl: .*(creating [0-9]+ I/O queues|reconnect|Reconnecting|error recovery|resetting)")
  [ -z "$dm" ] || { echo "$dm" | sed 's/^/    dmesg: /'; say "$ctrl reconnected during the reload"; rc=1; }
  [ $rc = 0 ] && say "$ctrl (cntlid $cntlid) stayed live, no reconnect"
  CTRL=$ctrl; disconnect
  return $rc
}

cleanup() {
  local c
  for c in /sys/class/nvme/nvme*; do
    case $(cat $c/subsysnqn 2>/dev/null) in "$NQN" | "$OPEN_NQN") echo 1 > $c/delete_controller 2>/dev/null ;; esac
  done
  [ -n "$NGWPID" ] && kill -KILL "$NGWPID" 2>/dev/null
  [ -n "$NGWLOG" ] && cp "$NGWLOG" "$LOGDIR/" 2>/dev/null
  kill_gateway
  dmesg > "$LOGDIR/dmesg.log" 2>/dev/null
}
trap cleanup EXIT
summary_extra() { [ $SKIPPED -gt 0 ] && echo "skipped checks (gateway-only, --kernel-target): $SKIPPED"; }

# ------------------------------------------------------------------ main --
echo "e2e-auth: mode=$MODE guest $(uname -r), $(nproc) vCPU, nvme-cli $(nvme version 2>/dev/null | head -1 | awk '{print $3}'), logs in $LOGDIR"
[ "$MODE" = gateway ] && echo "e2e-auth: gateway $GW"
ALL=(keys target.start a.connect-unidirectional a.fio-verify a.list-subsys-sysfs a.disconnect
  b.connect-bidirectional b.fio-verify c.reauth b.disconnect d.wrong-host-key d2.good-host-after
  e.no-secret f.wrong-ctrl-key x1.no-ctrl-key g.hmac-0 g.hmac-1 g.hmac-2 g.hmac-3)
for c in "${NEG_CASES[@]}"; do ALL+=("n.${c/ /-}"); done
ALL+=(i.no-auth-host j.digests-auth r.rdma-bidirectional r2.rdma-failure2-repeat s.reload k.sigterm)
FIRST=a.connect-unidirectional  # the first step after target.start
[ "${E2E_AUTH_RDMA_ONLY:-0}" = 1 ] && ALL=(keys target.start r.rdma-bidirectional r2.rdma-failure2-repeat k.sigterm) FIRST=r.rdma-bidirectional

step setup.modprobe "load nvme-tcp$([ $MODE = kernel ] && echo ', nvmet-tcp, null_blk')" \
  eval 'modprobe -a nvme-core nvme-tcp && { [ $MODE = gateway ] || { modprobe -a nvmet nvmet-tcp && modprobe null_blk nr_devices=0; }; }'
if ! step kernel.auth "the guest kernel has NVMe in-band authentication (DH-HMAC-CHAP)" auth_kernel_check; then
  skip_from keys "the guest kernel has no NVMe auth"
elif ! step keys "nvme gen-dhchap-key: host and ctrl keys, --hmac=0..3" gen_keys; then
  skip_from target.start "no keys"
elif ! { { [ "$MODE" = kernel ] || step setup.rxe "Soft-RoCE for step r: rdma link add rxe0 type rxe netdev eth0" rxe_setup; }
         step target.start "start the target on $ADDR:$PORT (hosts with keys)" start_target; }; then
  skip_from $FIRST "the target did not start"
elif [ "${E2E_AUTH_RDMA_ONLY:-0}" = 1 ]; then
  step r.rdma-bidirectional "nvme-rdma over Soft-RoCE, bidirectional auth on every queue, fio verify 8M" rdma_check
  step r2.rdma-failure2-repeat "nvme-rdma, wrong ctrl key (Failure2) $FAILURE2_RUNS times: each connect fails within $FAILURE2_BOUND s, none hangs" rdma_failure2_repeat
  step k.sigterm "SIGTERM: the gateway exits 0" stop_target
else
  if step a.connect-unidirectional "connect with --dhchap-secret: authenticated (hmac($DEF_HASH), $DEF_DHGROUP), controller not" a_connect; then
    step a.fio-verify "fio 4K randwrite 8M + crc32c verify" fio_small uni-4k 8M
    step a.list-subsys-sysfs "nvme list-subsys and sysfs show the live controller and its secret" a_list
    step a.disconnect "nvme disconnect" disconnect
  else
    skip_list "connect failed" a.fio-verify a.list-subsys-sysfs a.disconnect; disconnect > /dev/null
  fi
  if step b.connect-bidirectional "connect with --dhchap-secret and --dhchap-ctrl-secret: the controller authenticated too" b_connect; then
    step b.fio-verify "fio 4K randwrite 8M + crc32c verify" fio_small bidi-4k 8M
    step c.reauth "same secret written to sysfs dhchap_secret: every queue re-authenticates, fio verify 4M" reauth_check
    step b.disconnect "nvme disconnect" disconnect
  else
    skip b.fio-verify "connect failed"; skip c.reauth "connect failed"; skip b.disconnect "connect failed"; disconnect > /dev/null
  fi
  step d.wrong-host-key "a wrong host key: connect fails, the gateway stays up and says why" \
    expect_fail 'qid 0: authentication failed' 1 $NQN "$PORT" "$H_MAIN" $ID_MAIN --dhchap-secret="$K_BAD"
  step d2.good-host-after "then a host with the right key connects and reads" good_after
  step e.no-secret "a host that has a key connects without --dhchap-secret: fails" \
    expect_fail 'qid 0: no key' 0 $NQN "$PORT" "$H_MAIN" $ID_MAIN
  step f.wrong-ctrl-key "--dhchap-ctrl-secret not the controller's: the host refuses the controller" \
    expect_fail 'qid 0: controller authentication failed' 0 $NQN "$PORT" "$H_MAIN" $ID_MAIN \
    --dhchap-secret="$K_MAIN" --dhchap-ctrl-secret="$C_BAD"
  step x1.no-ctrl-key "bidirectional asked for, the target has no ctrl key for the host: connect fails" \
    expect_fail 'qid 0: authentication failed' 0 $NQN "$PORT" "$H_UNI" $ID_UNI \
    --dhchap-secret="$K_UNI" --dhchap-ctrl-secret="$C_MAIN"
  for i in 0 1 2 3; do
    step g.hmac-$i "keys from gen-dhchap-key --hmac=$i ($(key_len "${K_T[i]}")-byte): bidirectional connect" transform_check $i
  done
  for c in "${NEG_CASES[@]}"; do
    set -- $c
    step "n.$1-$2" "target restricted to $1 / $2: the host and the target agree on them" neg_check "$1" "$2"
  done
  step i.no-auth-host "a host allowed without a key ($OPEN_NQN) with --dhchap-secret: no authentication, fio verify 8M" open_check
  step j.digests-auth "header + data digests with bidirectional auth, fio verify 8M" digest_check
  step r.rdma-bidirectional "nvme-rdma over Soft-RoCE, bidirectional auth on every queue, fio verify 8M" rdma_check
  step r2.rdma-failure2-repeat "nvme-rdma, wrong ctrl key (Failure2) $FAILURE2_RUNS times: each connect fails within $FAILURE2_BOUND s, none hangs" rdma_failure2_repeat
  step s.reload "SIGHUP: a subsystem added, a key changed; a host on an untouched subsystem stays connected, fio verify passes" reload_check
  step k.sigterm "SIGTERM: the gateway exits 0" stop_target
fi

cleanup; trap - EXIT
guest_summary "e2e-auth summary (mode $MODE, guest $(uname -r), TCG)" summary_extra
[ $FAIL -eq 0 ]
