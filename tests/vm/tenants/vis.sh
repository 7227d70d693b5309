# shellcheck shell=bash
# vis.sh - e2e-tenants part "vis": per-host namespace visibility (issue 25) with the real
# Linux host. Sourced by tests/vm/e2e-tenants-guest.sh (see its header for ADDR, PORTS, ctl,
# ask, step...). The guest connects to gw1 as two hosts, A and B (own host NQN and host ID),
# each from its own source address: nvme-cli 2.3 refuses a second connect to the same
# subsystem, address and port ("already connected") unless host_traddr differs, whatever the
# host NQN. A is 10.0.2.15 (eth0's address), B 10.0.2.16, added to eth0 for this part and
# removed after it. Native multipath stays as the other parts have it (on): the two hosts'
# controllers share the subsystem's multipath heads, so what each host sees is read per
# controller (its namespaces in sysfs, and Identify sent to its own controller).
#
# Namespaces (all in ANA group 1, optimized on gw1): 1 shared (visible to every allowed host),
# 2 only A's, 3 only B's (added with --no-auto-visible, then namespace add-host).
#
# Steps:
#   vis.setup     images, subsystem, A and B allowed, the three namespaces, B's address;
#                 the nvme_async_event tracepoint on
#   vis.connect   A and B connected to gw1 (two controllers)
#   vis.visible   A's controller has namespaces 1 and 2, B's 1 and 3 (sysfs, nvme list-ns);
#                 Identify Namespace of the other host's namespace is zeroed (nvme id-ns:
#                 nsze 0), its descriptor list refused; a direct read of each host's own
#                 namespace works
#   vis.refused   bad input refused, state unchanged: add-host twice, del-host of a host not
#                 on the list, add-host on the shared namespace, an unknown NSID
#   vis.add-host  namespace add-host 3 A while connected: A's controller gets namespace 3
#                 (the kernel rescans on the AEN) without reconnecting (same controller);
#                 B's controller gets no Namespace Attribute Changed
#   vis.del-host  namespace del-host 2 A: A's controller loses namespace 2, B's unchanged
#                 and not told
#   vis.cleanup   disconnect both, subsystem and images deleted, B's address and the
#                 tracepoint as they were
VIS_NQN=nqn.2016-06.io.ceph-nvmeof-rs:tenants-vis
VIS_HOST_A=nqn.2014-08.org.nvmexpress:uuid:7a1e0000-0000-4000-8000-00000000000a
VIS_HOST_B=nqn.2014-08.org.nvmexpress:uuid:7a1e0000-0000-4000-8000-00000000000b
VIS_ID_A=7a1e0000-0000-4000-8000-00000000000a
VIS_ID_B=7a1e0000-0000-4000-8000-00000000000b
VIS_SRC_A=10.0.2.15
VIS_SRC_B=10.0.2.16
VIS_IMAGES=(vis-shared vis-a vis-b)
VIS_TRACE=/sys/kernel/tracing
VIS_AEN_NS_CHANGED=0x040002  # AEN result: notice, namespace attribute changed, log page 04h
VIS_ADDED_ADDR=0 VIS_TRACE_ON=0

vis_setup() {
  local i
  for i in "${VIS_IMAGES[@]}"; do ask 60 rbd-create "$i" 16 || return 1; done
  ctl subsystem add --nqn "$VIS_NQN" || return 1
  ctl host add -n "$VIS_NQN" --host "$VIS_HOST_A" || return 1
  ctl host add -n "$VIS_NQN" --host "$VIS_HOST_B" || return 1
  ctl namespace add -n "$VIS_NQN" --image vis-shared --nsid 1 --ana-group 1 || return 1
  ctl namespace add -n "$VIS_NQN" --image vis-a --nsid 2 --ana-group 1 --no-auto-visible || return 1
  ctl namespace add -n "$VIS_NQN" --image vis-b --nsid 3 --ana-group 1 --no-auto-visible || return 1
  ctl namespace add-host -n "$VIS_NQN" --nsid 2 --host "$VIS_HOST_A" || return 1
  ctl namespace add-host -n "$VIS_NQN" --nsid 3 --host "$VIS_HOST_B" || return 1
  ctl namespace list -n "$VIS_NQN" | sed 's/^/    | /'
  if ! ip -4 addr show dev eth0 | grep -q " $VIS_SRC_B/"; then
    ip addr add "$VIS_SRC_B/24" dev eth0 || return 1
    VIS_ADDED_ADDR=1
  fi
  [ -d $VIS_TRACE/events ] || mount -t tracefs nodev $VIS_TRACE 2>/dev/null
  if [ -w $VIS_TRACE/events/nvme/nvme_async_event/enable ]; then
    [ "$(cat $VIS_TRACE/events/nvme/nvme_async_event/enable)" = 1 ] || {
      echo 1 > $VIS_TRACE/events/nvme/nvme_async_event/enable && VIS_TRACE_ON=1
    }
  else
    say "no nvme_async_event tracepoint: which controllers got an AEN is not checked"
  fi
  # gw1 serves the three namespaces once the assignment is applied.
  sleep 2
}

vis_ctrl() { # A|B: the live controller (nvmeX) of $VIS_NQN connected as that host
  local c want
  [ "$1" = A ] && want=$VIS_HOST_A || want=$VIS_HOST_B
  for c in /sys/class/nvme/nvme*; do
    [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$VIS_NQN" ] || continue
    [ "$(cat "$c/hostnqn" 2>/dev/null)" = "$want" ] || continue
    [ "$(cat "$c/state" 2>/dev/null)" = live ] || continue
    echo "${c##*/}"; return 0
  done
  return 1
}

vis_connect_one() { # A|B SOURCE_ADDRESS
  local host id
  if [ "$1" = A ]; then host=$VIS_HOST_A id=$VIS_ID_A; else host=$VIS_HOST_B id=$VIS_ID_B; fi
  nvme connect -t tcp -a "$ADDR" -s "${PORTS[0]}" -n "$VIS_NQN" --hostnqn "$host" \
    --hostid "$id" --host-traddr "$2" 2>&1 | sed 's/^/    | /'
  local end=$(( $(date +%s) + 15 ))
  until vis_ctrl "$1" >/dev/null; do
    [ "$(date +%s)" -lt "$end" ] || { say "host $1 has no live controller"; return 1; }
    sleep 0.2
  done
}

vis_connect() {
  vis_connect_one A "$VIS_SRC_A" && vis_connect_one B "$VIS_SRC_B" || return 1
  VIS_CTRL_A=$(vis_ctrl A) VIS_CTRL_B=$(vis_ctrl B)
  VIS_CNTLID_A=$(cat /sys/class/nvme/$VIS_CTRL_A/cntlid)
  VIS_CNTLID_B=$(cat /sys/class/nvme/$VIS_CTRL_B/cntlid)
  say "host A: $VIS_CTRL_A (cntlid $VIS_CNTLID_A), host B: $VIS_CTRL_B (cntlid $VIS_CNTLID_B)"
  [ "$VIS_CTRL_A" != "$VIS_CTRL_B" ]
}

vis_kernel_nsids() { # nvmeX: the NSIDs the kernel has for that controller, sorted, space-separated
  local d ids=()
  for d in /sys/class/nvme/"$1"/nvme*; do
    [ -r "$d/nsid" ] && ids+=("$(cat "$d/nsid")")
  done
  printf '%s\n' "${ids[@]}" | sort -n | tr '\n' ' ' | sed 's/ $//'
}

vis_listed_nsids() { # nvmeX: the active namespace list Identify returns to that controller
  nvme list-ns "/dev/$1" 2>/dev/null | sed -n 's/.*\]:0x\([0-9a-f]*\).*/\1/p' |
    while read -r h; do echo $((16#$h)); done | tr '\n' ' ' | sed 's/ $//'
}

vis_expect() { # nvmeX WANT SECONDS: until the kernel's and Identify's lists of nvmeX are WANT
  local end=$(( $(date +%s) + $3 )) k l
  while :; do
    k=$(vis_kernel_nsids "$1") l=$(vis_listed_nsids "$1")
    [ "$k" = "$2" ] && [ "$l" = "$2" ] && { say "$1: kernel namespaces [$k], active list [$l]"; return 0; }
    [ "$(date +%s)" -lt "$end" ] || { say "$1: kernel namespaces [$k], active list [$l], want [$2]"; return 1; }
    sleep 0.3
  done
}

vis_nsze() { # nvmeX NSID: NSZE of Identify Namespace sent to that controller
  nvme id-ns "/dev/$1" -n "$2" -o json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["nsze"])'
}

vis_head() { # NSID: the multipath head (or plain) block device of $VIS_NQN's namespace NSID
  local NQN=$VIS_NQN
  ns_dev_once "$1"
}

vis_visible() {
  local ok=0 own other c me
  vis_expect "$VIS_CTRL_A" "1 2" 20 || ok=1
  vis_expect "$VIS_CTRL_B" "1 3" 20 || ok=1
  for me in A B; do
    if [ $me = A ]; then c=$VIS_CTRL_A own=2 other=3; else c=$VIS_CTRL_B own=3 other=2; fi
    local n_own n_other
    n_own=$(vis_nsze "$c" $own) n_other=$(vis_nsze "$c" $other)
    say "host $me: id-ns $own nsze=$n_own, id-ns $other nsze=$n_other (hidden: zeroed)"
    [ "${n_own:-0}" -gt 0 ] && [ "$n_other" = 0 ] || ok=1
    if nvme ns-descs "/dev/$c" -n $other >/dev/null 2>&1; then
      say "host $me: ns-descs of hidden namespace $other answered"; ok=1
    fi
  done
  local dev
  for n in 2 3; do
    dev=$(vis_head $n) || { say "no block device for namespace $n"; ok=1; continue; }
    dd if="$dev" of=/dev/null bs=4096 count=1 iflag=direct 2>/dev/null ||
      { say "read of $dev (namespace $n) failed"; ok=1; }
  done
  return $ok
}

vis_list_json() { ctl -o json namespace list -n "$VIS_NQN" | python3 -c '
import json, sys
print(json.dumps([(n["nsid"], n.get("no_auto_visible", False), sorted(n.get("hosts", [])))
                  for n in json.load(sys.stdin)["namespaces"]]))'; }

vis_refused_one() { # DESCRIPTION WANT_IN_STDERR ctl ARGS...: must fail, stderr naming WANT
  local what=$1 want=$2 err; shift 2
  if err=$("$@" 2>&1 >/dev/null); then say "$what: accepted"; return 1; fi
  say "$what: ${err#nvmeofctl: }"
  [[ $err == *"$want"* ]]
}

vis_refused() {
  local before after ok=0
  before=$(vis_list_json) || return 1
  vis_refused_one "add-host twice" "already sees" \
    ctl namespace add-host -n "$VIS_NQN" --nsid 2 --host "$VIS_HOST_A" || ok=1
  vis_refused_one "del-host of a host not on the list" "not on the host list" \
    ctl namespace del-host -n "$VIS_NQN" --nsid 2 --host "$VIS_HOST_B" || ok=1
  vis_refused_one "add-host on the shared namespace" "visible to every allowed host" \
    ctl namespace add-host -n "$VIS_NQN" --nsid 1 --host "$VIS_HOST_A" || ok=1
  vis_refused_one "unknown NSID" "not found" \
    ctl namespace add-host -n "$VIS_NQN" --nsid 9 --host "$VIS_HOST_A" || ok=1
  vis_refused_one "unknown subsystem" "not found" \
    ctl namespace add-host -n "$VIS_NQN-none" --nsid 2 --host "$VIS_HOST_A" || ok=1
  after=$(vis_list_json) || return 1
  [ "$before" = "$after" ] || { say "state changed: $before -> $after"; ok=1; }
  return $ok
}

vis_aens() { # nvmeX: Namespace Attribute Changed AENs traced for that controller so far
  [ -r $VIS_TRACE/trace ] || { echo 0; return 0; }
  grep -cE "nvme_async_event: $1: NVME_AEN=0x0*${VIS_AEN_NS_CHANGED#0x0*}" $VIS_TRACE/trace
}

vis_change() { # add|del NSID HOST(A|B) WANT_A WANT_B
  local verb=$1 nsid=$2 who=$3 host aen_a aen_b ok=0
  [ "$who" = A ] && host=$VIS_HOST_A || host=$VIS_HOST_B
  aen_a=$(vis_aens "$VIS_CTRL_A") aen_b=$(vis_aens "$VIS_CTRL_B")
  ctl namespace "$verb-host" -n "$VIS_NQN" --nsid "$nsid" --host "$host" | sed 's/^/    | /'
  vis_expect "$VIS_CTRL_A" "$4" 20 || ok=1
  vis_expect "$VIS_CTRL_B" "$5" 5 || ok=1
  # Not reconnected: the same controllers, live.
  [ "$(vis_ctrl A)" = "$VIS_CTRL_A" ] && [ "$(cat /sys/class/nvme/$VIS_CTRL_A/cntlid)" = "$VIS_CNTLID_A" ] ||
    { say "host A's controller changed"; ok=1; }
  [ "$(vis_ctrl B)" = "$VIS_CTRL_B" ] || { say "host B's controller changed"; ok=1; }
  if [ -r $VIS_TRACE/trace ]; then
    local got_a got_b
    got_a=$(( $(vis_aens "$VIS_CTRL_A") - aen_a )) got_b=$(( $(vis_aens "$VIS_CTRL_B") - aen_b ))
    say "Namespace Attribute Changed AENs: host A $got_a, host B $got_b"
    [ "$got_a" -ge 1 ] && [ "$got_b" -eq 0 ] || ok=1
  fi
  return $ok
}

vis_cleanup() {
  local ok=0 i
  nvme disconnect -n "$VIS_NQN" >/dev/null 2>&1
  local end=$(( $(date +%s) + 10 ))
  while vis_ctrl A >/dev/null || vis_ctrl B >/dev/null; do
    [ "$(date +%s)" -lt "$end" ] || { say "controllers still there"; ok=1; break; }
    sleep 0.2
  done
  ctl subsystem del --nqn "$VIS_NQN" --force || ok=1
  sleep 1  # the gateways close the namespaces' images
  for i in "${VIS_IMAGES[@]}"; do ask 60 rbd-rm "$i" || ok=1; done
  [ $VIS_ADDED_ADDR = 1 ] && { ip addr del "$VIS_SRC_B/24" dev eth0 || ok=1; }
  [ $VIS_TRACE_ON = 1 ] && echo 0 > $VIS_TRACE/events/nvme/nvme_async_event/enable
  return $ok
}

tenant_vis() {
  if step vis.setup "images, subsystem, hosts A and B, namespaces 1 (all), 2 (A), 3 (B)" vis_setup &&
     step vis.connect "hosts A ($VIS_SRC_A) and B ($VIS_SRC_B) connected to gw1" vis_connect; then
    step vis.visible "A sees 1 and 2, B 1 and 3; hidden ones zeroed in id-ns" vis_visible
    step vis.refused "bad add-host/del-host refused, state unchanged" vis_refused
    step vis.add-host "add-host 3 A: A gets namespace 3 live, B not told" vis_change add 3 A "1 2 3" "1 3"
    step vis.del-host "del-host 2 A: A loses namespace 2 live, B not told" vis_change del 2 A "1 3" "1 3"
  else
    skip vis.visible "setup or connect failed"
  fi
  step vis.cleanup "disconnect, subsystem and images deleted, address and tracepoint restored" vis_cleanup
}
