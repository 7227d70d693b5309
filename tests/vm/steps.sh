# shellcheck shell=bash
# steps.sh - the timed PASS/FAIL step framework shared by the e2e scripts (sourced, not run).
#
#   step NAME DESCRIPTION cmd...   run cmd, time it, record PASS/FAIL; returns cmd's status
#   skip NAME REASON               a step that could not run (counts as a failure)
#   say WORDS...                   an indented detail line
#   now / since T0                 seconds (from /proc/uptime) and the time elapsed since T0
#
# Knobs the sourcing script may set: STEP_PREFIX (e.g. "host:"), and a function
# on_step_failure, called after a failed step (to print a log tail, dmesg lines...).
# Results: PASS, FAIL, RESULTS (lines for the summary), T_ALL (start time).

now() { local u _; read -r u _ < /proc/uptime; echo "$u"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }
say() { echo "    $*"; }

STEP_PREFIX=${STEP_PREFIX:-}
# shellcheck disable=SC2034  # read by the sourcing script for its summary
T_ALL=$(now)
PASS=0 FAIL=0 RESULTS=()

_step_width() { echo $((28 - ${#STEP_PREFIX})); }

step() {
  local name=$1 desc=$2; shift 2
  local t0 rc dt w
  w=$(_step_width)
  echo "=== [$STEP_PREFIX$name] $desc"
  t0=$(now)
  "$@"
  rc=$?
  dt=$(since "$t0")
  if [ $rc -eq 0 ]; then
    echo "PASS [$STEP_PREFIX$name] (${dt}s)"
    PASS=$((PASS + 1)); RESULTS+=("$(printf "PASS  %s%-${w}s %8ss" "$STEP_PREFIX" "$name" "$dt")")
  else
    echo "FAIL [$STEP_PREFIX$name] rc=$rc (${dt}s): $desc"
    FAIL=$((FAIL + 1)); RESULTS+=("$(printf "FAIL  %s%-${w}s %8ss  rc=%s" "$STEP_PREFIX" "$name" "$dt" "$rc")")
    if declare -F on_step_failure >/dev/null; then on_step_failure; fi
  fi
  return $rc
}

skip() {
  local w
  w=$(_step_width)
  echo "FAIL [$STEP_PREFIX$1] not run: $2"
  FAIL=$((FAIL + 1)); RESULTS+=("$(printf "FAIL  %s%-${w}s %8s   not run: %s" "$STEP_PREFIX" "$1" - "$2")")
}
