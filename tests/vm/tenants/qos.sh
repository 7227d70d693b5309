# shellcheck shell=bash
# tests/vm/tenants/qos.sh - e2e-tenants part "qos" (sourced by e2e-tenants-guest.sh): per-namespace
# QoS limits and the image lifecycle through nvmeofctl, with the real Linux host.
#
#   qos.setup     subsystem, two namespaces on ANA group 1 (gw1) whose images the control plane
#                 creates (namespace add --create-image --size), connected through both gateways
#   qos.refused   bad limits (5 IOPS, absurd MB/s) and an unknown namespace: refused, limits as
#                 they were; --delete-image while connected: refused
#   qos.iops      4K randread QD16 on nsid 1 unthrottled, then limited to a quarter of that
#                 (set-qos live) while nsid 2 runs beside it: nsid 1 within 10% of its limit,
#                 nsid 2 keeps at least half its own unthrottled rate
#   qos.bw        the same for bandwidth (64K reads, rw_megabytes_per_second)
#   qos.failover  IOPS limit, kill -9 gw1, the path through gw2 optimized: the limit holds
#                 there; gw1 started again, and optimized again for the host (failback)
#   qos.cleanup   disconnect; namespace del --delete-image (the image is gone: adding it back
#                 without --create-image is refused); subsystem deleted
# Rates: fio --output-format=json, 1 s ramp then 3 s measured.

QOS_NQN=nqn.2016-06.io.ceph-nvmeof-rs:tenants-qos
QOS_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2e25000-0000-4000-8000-0000000000a5
QOS_HOSTID=e2e25000-0000-4000-8000-0000000000a5
QOS_IMAGES=(tenants-qos-a tenants-qos-b)

qos_dev() { NQN=$QOS_NQN ns_dev "$1" 150; }

# qos_fio NSID BS [SECONDS]: randread at QD16; prints "IOPS MIBPS"
qos_fio() {
  local dev out
  dev=$(qos_dev "$1") || { say "no block device for nsid $1"; return 1; }
  out=$WORK/qos-fio-$1-$2.json
  (cd /tmp && timeout -k 5 60 fio --name=qos --filename="$dev" --direct=1 --ioengine=libaio \
     --rw=randread --bs="$2" --iodepth=16 --time_based --ramp_time=1 --runtime="${3:-3}" \
     --output-format=json) > "$out" 2>"$out.err" || { say "fio on nsid $1 failed: $(tail -n 3 "$out.err")"; return 1; }
  python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))["jobs"][0]["read"]
print("%.0f %.2f" % (r["iops"], r["bw_bytes"] / 1048576))' "$out"
}

# qos_within MEASURED LIMIT WHAT: measured within 10% of limit
qos_within() {
  say "$3: measured $1, limit $2"
  awk -v m="$1" -v l="$2" 'BEGIN { exit !(m >= 0.9 * l && m <= 1.1 * l) }'
}

qos_setup() {
  ctl subsystem add --nqn "$QOS_NQN" || return 1
  ctl host add -n "$QOS_NQN" --host "$QOS_HOSTNQN" || return 1
  local i
  for i in 1 2; do ctl listener add -n "$QOS_NQN" -g "gw$i" -a 127.0.0.1 -p "${PORTS[$((i - 1))]}" || return 1; done
  for i in 1 2; do
    ctl namespace add -n "$QOS_NQN" --image "${QOS_IMAGES[$((i - 1))]}" --nsid "$i" --ana-group 1 \
      --create-image --size 64MiB || return 1
  done
  # The image exists now: a second --create-image of it is refused.
  if ctl namespace add -n "$QOS_NQN" --image "${QOS_IMAGES[0]}" --nsid 3 --create-image --size 64MiB 2> "$WORK/qos-exists.err"; then
    say "a second --create-image of ${QOS_IMAGES[0]} was accepted"; return 1
  fi
  say "again: $(cat "$WORK/qos-exists.err")"
  for i in 0 1; do
    timeout -k 5 60 nvme connect -t tcp -a "$ADDR" -s "${PORTS[$i]}" -n "$QOS_NQN" \
      --hostnqn="$QOS_HOSTNQN" --hostid="$QOS_HOSTID" --ctrl-loss-tmo=600 --reconnect-delay=1 || return 1
  done
  qos_dev 1 > /dev/null && qos_dev 2 > /dev/null || return 1
  ctl namespace list -n "$QOS_NQN" | sed 's/^/    | /'
}

qos_limits_of() { # NSID: the QOS column of namespace list
  ctl -o json namespace list -n "$QOS_NQN" | python3 -c '
import json, sys
for n in json.load(sys.stdin)["namespaces"]:
    if n["nsid"] == int(sys.argv[1]):
        print(json.dumps(n.get("qos"), sort_keys=True))' "$1"
}

qos_refused() {
  ctl namespace set-qos -n "$QOS_NQN" --nsid 1 --rw-ios-per-second 1000 || return 1
  local before; before=$(qos_limits_of 1)
  local bad
  for bad in "--nsid 1 --rw-ios-per-second 5" "--nsid 1 --r-megabytes-per-second 99999999" \
             "--nsid 9 --rw-ios-per-second 1000"; do
    # shellcheck disable=SC2086  # the arguments of one case
    if ctl namespace set-qos -n "$QOS_NQN" $bad 2> "$WORK/qos-refused.err"; then say "accepted: $bad"; return 1; fi
    say "$bad: $(cat "$WORK/qos-refused.err")"
  done
  [ "$(qos_limits_of 1)" = "$before" ] || { say "limits changed: $before -> $(qos_limits_of 1)"; return 1; }
  if ctl namespace del -n "$QOS_NQN" --nsid 2 --delete-image 2> "$WORK/qos-refused.err"; then
    say "--delete-image accepted while connected"; return 1
  fi
  say "del --delete-image while connected: $(cat "$WORK/qos-refused.err")"
  ctl namespace set-qos -n "$QOS_NQN" --nsid 1 --rw-ios-per-second 0 || return 1
  [ "$(ctl namespace list -n "$QOS_NQN" | awk '$2 == 2' | wc -l)" -eq 1 ] || { say "namespace 2 gone"; return 1; }
}

QOS_IOPS_LIMIT=0
qos_iops() {
  local base limit limited other base2
  read -r base _ < <(qos_fio 1 4k) || return 1
  read -r base2 _ < <(qos_fio 2 4k) || return 1
  say "unthrottled: nsid 1 $base IOPS, nsid 2 $base2 IOPS"
  limit=$(( ${base%.*} / 4 ))
  [ "$limit" -ge 50 ] || { say "unthrottled rate $base too low to test a limit"; return 1; }
  QOS_IOPS_LIMIT=$limit
  ctl namespace set-qos -n "$QOS_NQN" --nsid 1 --rw-ios-per-second "$limit" || return 1
  qos_fio 2 4k 3 > "$WORK/qos-other" &
  local pid=$!
  read -r limited _ < <(qos_fio 1 4k) || return 1
  wait $pid || return 1
  read -r other _ < "$WORK/qos-other"
  say "nsid 2 beside it: $other IOPS"
  qos_within "$limited" "$limit" "nsid 1 IOPS" || return 1
  awk -v o="$other" -v b="$base2" 'BEGIN { exit !(o >= 0.5 * b) }' || { say "nsid 2 fell to $other (alone: $base2)"; return 1; }
}

qos_bw() {
  local base limit limited
  ctl namespace set-qos -n "$QOS_NQN" --nsid 1 --rw-ios-per-second 0 || return 1
  read -r _ base < <(qos_fio 1 64k) || return 1
  limit=$(awk -v b="$base" 'BEGIN { l = int(b / 4); print (l < 1 ? 0 : l) }')
  say "unthrottled: nsid 1 $base MiB/s"
  [ "$limit" -ge 1 ] || { say "unthrottled bandwidth $base MiB/s too low to test a limit"; return 1; }
  ctl namespace set-qos -n "$QOS_NQN" --nsid 1 --rw-megabytes-per-second "$limit" || return 1
  read -r _ limited < <(qos_fio 1 64k) || return 1
  qos_within "$limited" "$limit" "nsid 1 MiB/s" || return 1
  ctl namespace set-qos -n "$QOS_NQN" --nsid 1 --rw-megabytes-per-second 0 || return 1
}

# qos_optimized_via PORT SECONDS: nsid 1's path through PORT is optimized
qos_optimized_via() {
  local end=$(( $(date +%s) + $2 )) p c a st
  while [ "$(date +%s)" -lt "$end" ]; do
    for p in /sys/block/nvme*c*n*; do
      [ -e "$p/ana_state" ] || continue
      [ "$(cat "$p/nsid" 2>/dev/null)" = 1 ] || continue
      c=${p##*/}; c=${c#nvme*c}; c=nvme${c%%n*}
      [ "$(cat "/sys/class/nvme/$c/subsysnqn" 2>/dev/null)" = "$QOS_NQN" ] || continue
      a=$(cat "/sys/class/nvme/$c/address" 2>/dev/null); st=$(cat "$p/ana_state" 2>/dev/null)
      [[ $a == *"trsvcid=$1"* ]] && [ "$st" = optimized ] && return 0
    done
    sleep 0.2
  done
  return 1
}

qos_failover() {
  local limit=$QOS_IOPS_LIMIT limited ok=0
  [ "$limit" -gt 0 ] || { say "no IOPS limit from qos.iops"; return 1; }
  ctl namespace set-qos -n "$QOS_NQN" --nsid 1 --rw-ios-per-second "$limit" || return 1
  ask 30 kill-gw 1 || return 1
  if qos_optimized_via "${PORTS[1]}" 60; then
    say "nsid 1 optimized through gw2"
    read -r limited _ < <(qos_fio 1 4k) && qos_within "$limited" "$limit" "nsid 1 IOPS through gw2" || ok=1
  else
    say "nsid 1 not optimized through gw2 within 60 s"; ok=1
  fi
  ask 60 start-gw 1 || ok=1
  both_available 60 > /dev/null || ok=1
  # The host's path to the restarted gw1 is back (failback: optimized there again) before
  # the part goes on: cleanup must not disconnect a controller still reconnecting.
  if qos_optimized_via "${PORTS[0]}" 60; then say "failback: nsid 1 optimized through gw1 again"
  else
    say "nsid 1 not optimized through the restarted gw1 within 60 s; controllers:"
    local c
    for c in $(connected_ctrls "$QOS_NQN"); do say "  $c $(cat /sys/class/nvme/$c/state) $(cat /sys/class/nvme/$c/address)"; done
    ok=1
  fi
  return $ok
}

qos_cleanup() {
  local ok=0 i
  disconnect_nqn "$QOS_NQN" || { delete_ctrls "$QOS_NQN"; ok=1; }
  # The gateways' beacons must stop reporting the connections before --delete-image is taken.
  for i in 1 2; do
    local tries=0
    until ctl namespace del -n "$QOS_NQN" --nsid "$i" --delete-image 2> "$WORK/qos-del.err"; do
      tries=$((tries + 1))
      [ $tries -lt 20 ] || { say "nsid $i: $(cat "$WORK/qos-del.err")"; ok=1; break; }
      sleep 0.5
    done
  done
  # Gone from the pool: adding it back without --create-image finds no image.
  if ctl namespace add -n "$QOS_NQN" --image "${QOS_IMAGES[0]}" 2> "$WORK/qos-del.err"; then
    say "image ${QOS_IMAGES[0]} still there"; ok=1
  else
    say "after del --delete-image: $(cat "$WORK/qos-del.err")"
  fi
  ctl subsystem del --nqn "$QOS_NQN" --force || ok=1
  return $ok
}

tenant_qos() {
  if step qos.setup "subsystem, 2 namespaces on gw1 with images made by --create-image, connected" qos_setup; then
    step qos.refused "bad limits, unknown namespace, --delete-image while connected: refused, state unchanged" qos_refused
    step qos.iops "IOPS limit (a quarter of the unthrottled rate) within 10%, nsid 2 keeps its rate" qos_iops
    step qos.bw "bandwidth limit (a quarter of the unthrottled MiB/s) within 10%" qos_bw
    step qos.failover "IOPS limit holds through gw2 after kill -9 of gw1 (gw1 started again)" qos_failover
  else
    skip qos.refused "setup failed"; skip qos.iops "setup failed"; skip qos.bw "setup failed"; skip qos.failover "setup failed"
  fi
  step qos.cleanup "disconnect, namespace del --delete-image, subsystem deleted" qos_cleanup
}
