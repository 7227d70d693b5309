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
