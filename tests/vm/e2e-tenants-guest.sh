#!/bin/bash
# e2e-tenants-guest.sh - the in-guest half of tests/vm/e2e-tenants.sh (run through
# tests/vm/e2e-group.sh and tests/vm/run-in-vm.sh; not meant to be run by hand):
#
#   e2e-tenants-guest.sh SHARED_DIR ROUNDS PORT1,PORT2 CTL1,CTL2
#
# The group's gateways gw1 and gw2 run on the host (PORTn, ANA group n), reached here as
# 10.0.2.2; CTLn are its nvmeof-control replicas as reached from here. Steps:
#   setup      nvme-tcp loaded (native multipath as Debian has it: on)
#   control    nvmeofctl from here sees both gateways available
#   PART...    for each part in $E2E_TENANT_PARTS (comma-separated; default every
#              tests/vm/tenants/*.sh, in the order vis qos resv csi, then the others by name):
#              tests/vm/tenants/PART.sh is sourced and its function tenant_PART runs its own
#              steps (tests/vm/steps.sh `step`)
#   PART.after both gateways available again once the part is done (a part must leave the
#              group as it found it: its subsystem deleted, killed gateways restarted)
# A part has: ADDR, PORTS (gw1's port first), CTL_SERVERS, SH, SIG, LOGDIR (this run's
# guest logs), WORK (scratch), `ctl ARGS...` (nvmeofctl, 30 s timeout), `ask SECONDS
# REQUEST...` (the host's requests: kill-gw N, start-gw N, rbd-create IMAGE MIB, rbd-rm
# IMAGE, check IMAGE ...; see e2e-group.sh), `gw_available N` and guest-lib.sh's helpers.
# Last line: "N passed, N failed".
set -u
export LC_ALL=C

SH=${1:?usage: e2e-tenants-guest.sh SHARED_DIR ROUNDS PORT1,PORT2 CTL1,CTL2}
IFS=, read -r -a PORTS <<< "${3:?usage}"
CTL_SERVERS=${4:?usage}
SIG=$SH/sig
ADDR=10.0.2.2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=/tmp/e2e-tenants
mkdir -p "$WORK"
LOGDIR=$SH/guest
mkdir -p "$LOGDIR"
NQN=""  # guest-lib.sh's helpers read it; each part sets its own

. "$HERE/steps.sh"
. "$HERE/requests.sh"  # ask
. "$HERE/guest-lib.sh"
on_step_failure() { dmesg | grep -iE 'nvme' | tail -n 6 | sed 's/^/    dmesg: /'; }

ctl() { timeout -k 5 30 "$SH/bin/nvmeofctl" --server "$CTL_SERVERS" "$@"; }
gw_available() { # N: the control plane has gwN available
  ctl -o json gateway list 2>/dev/null | python3 -c '
import json, sys
sys.exit(0 if any(g["name"] == sys.argv[1] and g.get("availability") == "available"
                  for g in json.load(sys.stdin)["gateways"]) else 1)' "gw$1"
}
both_available() { # [SECONDS]: until gw1 and gw2 are available
  local end=$(( $(date +%s) + ${1:-30} ))
  until gw_available 1 && gw_available 2; do
    [ "$(date +%s)" -lt "$end" ] || { ctl gateway list | sed 's/^/    | /'; return 1; }
    sleep 0.2
  done
  ctl gateway list | sed 's/^/    | /'
}

parts() {
  local order=(vis qos resv csi) p f seen=" "
  if [ -n "${E2E_TENANT_PARTS:-}" ]; then tr ',' '\n' <<< "$E2E_TENANT_PARTS"; return; fi
  for p in "${order[@]}"; do [ -f "$HERE/tenants/$p.sh" ] && { echo "$p"; seen+="$p "; }; done
  for f in "$HERE"/tenants/*.sh; do
    [ -f "$f" ] || continue
    p=${f##*/}; p=${p%.sh}
    [[ $seen == *" $p "* ]] || echo "$p"
  done
}
run_part() { # PART
  local p=$1 f=$HERE/tenants/$1.sh
  [ -f "$f" ] || { skip "$p" "no tests/vm/tenants/$p.sh"; return; }
  # shellcheck disable=SC1090  # a part file, named at run time
  . "$f"
  declare -F "tenant_$p" >/dev/null || { skip "$p" "$f defines no tenant_$p"; return; }
  echo "---- part $p"
  "tenant_$p"
  step "$p.after" "both gateways available after part $p" both_available 60
}

cleanup() {
  dmesg > "$LOGDIR/dmesg.log" 2>/dev/null
}
trap cleanup EXIT

# ------------------------------------------------------------------ main --
echo "e2e-tenants-guest: guest $(uname -r), $(nproc) vCPU, nvme-cli $(nvme version 2>/dev/null | head -1 | awk '{print $3}'), gateways at $ADDR:${PORTS[*]}, control plane $CTL_SERVERS, parts: $(parts | tr '\n' ' ')"
if step setup "load nvme-tcp" modprobe nvme-tcp &&
   step control "nvmeofctl from the guest: gw1 and gw2 available" both_available 30; then
  for part in $(parts); do run_part "$part"; done
else
  for part in $(parts); do skip "$part" "setup failed"; done
fi
cleanup; trap - EXIT

guest_summary "e2e-tenants guest summary (guest $(uname -r), TCG)"
[ $FAIL -eq 0 ]
