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
