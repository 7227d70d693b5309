# shellcheck shell=bash
# requests.sh - how a guest script asks its host script to act (sourced, not run; after
# steps.sh, whose now/since/say it uses). Both sides set SIG to the shared request directory.
#
# Guest:  ask SECONDS WORDS...   writes SIG/NNN.req (one line), waits up to SECONDS for
#                                SIG/NNN.done, prints it; returns 0 when its first line is "ok"
# Host:   serve_requests         answers every waiting request: the sourcing script's
#                                `handle` reads the request line on stdin and writes the answer
#                                ("ok" or "fail", then details) on stdout
#         show_vm_output         prints the lines of $VMOUT (the VM's output) not yet shown
#         run_guest ARGS...      boots the VM (tests/vm/run-in-vm.sh ARGS, output in $VMOUT,
#                                its PID in VMPID while it runs), serves its requests until
#                                it exits and sets GUEST_PASS/GUEST_FAIL from the guest's
#                                summary line; 0 when the VM exited 0 with no failed step
# Host scripts (tests/vm/e2e-{rbd,group,demo}.sh) also share:
#         shared_dir NAME        SH=$E2E_LOG_DIR/NAME (default $ROOT/target/vm-logs/NAME, the
#                                directory shared with the guest), SIG, VMOUT
#         fresh_shared_dir NAME  SH emptied, SIG created (exit 2 when it cannot be), WORK = a new
#                                private temporary directory
#         stop_process PID TENTHS MESSAGE   cleanup: when PID runs, MESSAGE, SIGTERM, SIGKILL
#                                after TENTHS tenths of a second
#         stop_vm NAME           stop_process of run-in-vm.sh (its own trap kills qemu), 15 s
#         port_free PORT         nothing listens on PORT
#         port_unused PORT       no socket of any state has PORT as its local port
#         free_port [USED...]    an unused port in 20000-31999 (not one of USED): below
#                                Linux's ephemeral range (32768-60999), where an outgoing
#                                connection may take it before our bind; above micro Ceph's
#                                mon ports (10000-19999)
#         copy_binaries DIR      private copies of nvmeof-gateway, nvmeof-control, nvmeofctl
#                                from $BIN_SRC (a concurrent cargo build must not replace them)
#         start_cluster ARGS...  a micro Ceph in $WORK/ceph (ARGS: micro-ceph.sh start options);
#                                sets CEPHDIR, exports CEPH_CONF and CEPH_KEYRING
#         check_export HEADER EXPORT {zero OFF LEN | cmp OFF FILE}...   the answer to a guest's
#                                check request: each range of the file EXPORT is zeros / equals
#                                FILE (in $SH); "ok" or "fail", then HEADER and a line a range
#         check_image IMAGE {zero OFF LEN | cmp OFF FILE}...   check_export of `rbd export
#                                $POOL/IMAGE` (IMAGE must pass the sourcing script's image_ok)
#         host_summary TITLE [FN]  the summary over host and guest steps (FN prints extra lines);
#                                last line "N passed, N failed"; 0 when none failed

REQ=0
ask() {
  local t=$1 id; shift
  REQ=$((REQ + 1)); id=$SIG/$(printf '%03d' $REQ)
  echo "$*" > "$id.tmp" && mv "$id.tmp" "$id.req" || { say "cannot write $id.req"; return 1; }
  local end; end=$(awk -v n="$(now)" -v t="$t" 'BEGIN{print n + t}')
  until [ -e "$id.done" ]; do
    awk -v n="$(now)" -v e="$end" 'BEGIN{exit !(n > e)}' && { say "the host did not answer '$*' within ${t}s"; return 1; }
    sleep 0.1
  done
  sed 's/^/    host: /' "$id.done"
  [ "$(head -n 1 "$id.done")" = ok ]
}

serve_requests() {
  local r id t0
  for r in "$SIG"/*.req; do
    [ -e "$r" ] || continue
    id=${r%.req}
    mv "$r" "$id.taken" || continue
    echo "    host: request ${id##*/}: $(head -c 200 "$id.taken")"
    t0=$(now)
    handle < "$id.taken" > "$id.tmp" 2>&1
    echo "(host took $(since "$t0")s)" >> "$id.tmp"
    mv "$id.tmp" "$id.done"
    echo "    host: answered ${id##*/}: $(head -n 1 "$id.done") ($(since "$t0")s)"
  done
}

SHOWN=0
show_vm_output() {
  local n
  [ -f "$VMOUT" ] || return 0
  n=$(wc -l < "$VMOUT")
  [ "$n" -gt "$SHOWN" ] && { sed -n "$((SHOWN + 1)),${n}p" "$VMOUT"; SHOWN=$n; }
  return 0
}

GUEST_PASS=0 GUEST_FAIL=0
run_guest() {
  "$ROOT/tests/vm/run-in-vm.sh" "$@" > "$VMOUT" 2>&1 3>&- &
  VMPID=$!
  while kill -0 "$VMPID" 2>/dev/null; do
    show_vm_output
    serve_requests
    sleep 0.2
  done
  wait "$VMPID"; local rc=$?
  VMPID=""
  show_vm_output
  local last
  last=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$VMOUT" | tail -n 1)
  if [ -z "$last" ]; then say "no guest summary line (VM exit status $rc)"; GUEST_FAIL=1; return 1; fi
  GUEST_PASS=${last%% passed*}
  GUEST_FAIL=${last#*passed, }; GUEST_FAIL=${GUEST_FAIL%% failed}
  say "guest: $last (VM exit status $rc)"
  [ "$rc" -eq 0 ] && [ "$GUEST_FAIL" -eq 0 ]
}

shared_dir() {
  local base=${E2E_LOG_DIR:-$ROOT/target/vm-logs}
  case $base in /*) ;; *) base=$PWD/$base ;; esac
  SH=$base/$1
  SIG=$SH/sig
  VMOUT=$SH/vm-output.log
}
fresh_shared_dir() {
  rm -rf "$SH"
  mkdir -p "$SIG" || { echo "cannot create $SIG"; echo "0 passed, 1 failed"; exit 2; }
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")
}
stop_process() {
  [ -n "$1" ] && kill -0 "$1" 2>/dev/null || return 0
  echo "$3"
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq "$2"); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
  return 0
}
stop_vm() { stop_process "$VMPID" 150 "$1: stopping the VM (run-in-vm.sh pid $VMPID)"; }

port_free() { ! ss -Hltn "sport = :$1" | grep -q .; }
port_unused() { ! ss -Htan "sport = :$1" | grep -q .; }
free_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 12000))
    port_unused "$p" || continue
    [[ " $* " == *" $p "* ]] && continue
    echo "$p"; return 0
  done
  return 1
}
copy_binaries() {
  local b
  mkdir -p "$1"
  for b in nvmeof-gateway nvmeof-control nvmeofctl; do
    [ -x "$BIN_SRC/$b" ] || { say "$BIN_SRC/$b missing (cargo build --release -p nvmeof-gateway -p control-plane)"; return 1; }
    cp "$BIN_SRC/$b" "$1/$b" || return 1
  done
  say "$(ls "$1" | tr '\n' ' ')from $BIN_SRC"
}
start_cluster() {
  local envl
  CEPHDIR=$WORK/ceph
  envl=$(MICRO_CEPH_VERBOSE=1 timeout -k 10 300 "$ROOT/scripts/micro-ceph.sh" start --dir "$CEPHDIR" \
    "$@" --image '' 3>&-) || { say "micro-ceph.sh start failed"; return 1; }
  eval "$envl"
  export CEPH_CONF CEPH_KEYRING
  say "cluster in $CEPHDIR, CEPH_CONF=$CEPH_CONF"
}

check_export() {
  local lines=("$1") exp=$2 rc=0 off len f; shift 2
  while [ $# -gt 0 ]; do
    case $1 in
      zero)
        off=${2:-} len=${3:-}; shift 3 2>/dev/null || shift $#
        [[ $off =~ ^[0-9]+$ ]] && [[ $len =~ ^[0-9]+$ ]] || { echo fail; echo "bad zero range"; return; }
        if cmp -s -i "$off:0" -n "$len" "$exp" /dev/zero; then lines+=("[$off, +$len) reads zeros in the export")
        else lines+=("MISMATCH: [$off, +$len) is not all zeros in the export: $(cmp -i "$off:0" -n "$len" "$exp" /dev/zero 2>&1 | head -1)"); rc=1; fi ;;
      cmp)
        off=${2:-} f=${3:-}; shift 3 2>/dev/null || shift $#
        [[ $off =~ ^[0-9]+$ ]] && [[ $f =~ ^[A-Za-z0-9._-]+$ ]] && [ -f "$SH/$f" ] || { echo fail; echo "bad cmp arguments ($off $f)"; return; }
        len=$(stat -c %s "$SH/$f")
        if cmp -s -i "$off:0" -n "$len" "$exp" "$SH/$f"; then lines+=("[$off, +$len) equals $f byte for byte")
        else lines+=("MISMATCH: [$off, +$len) differs from $f: $(cmp -i "$off:0" -n "$len" "$exp" "$SH/$f" 2>&1 | head -1)"); rc=1; fi ;;
      *) echo fail; echo "bad check word $1"; return ;;
    esac
  done
  [ $rc -eq 0 ] && echo ok || echo fail
  printf '%s\n' "${lines[@]}"
}
check_image() {
  local image=$1 exp=$WORK/export.img; shift
  image_ok "$image" || { echo fail; echo "unknown image $image"; return; }
  rm -f "$exp"
  if ! timeout -k 5 120 rbd export --no-progress "$POOL/$image" "$exp" > "$WORK/export.err" 2>&1; then
    echo fail; echo "rbd export $POOL/$image failed: $(cat "$WORK/export.err")"; return
  fi
  check_export "rbd export $POOL/$image: $(stat -c %s "$exp") bytes" "$exp" "$@"
  rm -f "$exp"
}

host_summary() {
  echo
  echo "================ $1 ================"
  printf '%s\n' "${RESULTS[@]}"
  grep -E '^(PASS|FAIL)  ' "$VMOUT" 2>/dev/null | sed 's/^/  guest: /'
  [ -n "${2:-}" ] && "$2"
  local total_pass=$((PASS + GUEST_PASS)) total_fail=$((FAIL + GUEST_FAIL))
  echo "host steps: $PASS passed, $FAIL failed; guest steps: $GUEST_PASS passed, $GUEST_FAIL failed"
  echo "total $(since "$T_ALL")s; logs: $SH"
  echo "$total_pass passed, $total_fail failed"
  [ "$total_fail" -eq 0 ]
}
