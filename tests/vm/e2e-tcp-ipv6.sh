# shellcheck shell=bash
# e2e-tcp-ipv6.sh - the IPv6 steps of e2e-tcp.sh (sourced by it, inside the test VM; uses its
# step framework, NQNs, MODE, GW, WORK and LOGDIR).
#
# The target listens on the dual-stack wildcard [::]:$PORT6 (our gateway: configured as
# address = "[::]:PORT", no port key; --kernel-target: an nvmet port with adrfam ipv6,
# traddr ::). The guest's eth0 gets a unique-local IPv6 address ($ADDR6, added with nodad:
# the QEMU user network runs with ipv6=off, so this address is reached over the guest's own
# loopback path). Steps:
#   v6.start       target on [::]:$PORT6
#   v6.discover    nvme discover at ::1, at $ADDR6 and at 127.0.0.1 (IPv4 through the
#                  dual-stack socket): the NVM subsystem's entry has adrfam ipv6 / traddr ::1,
#                  ipv6 / $ADDR6, and ipv4 / 127.0.0.1 (our gateway; nvmet lists that last
#                  one as ipv6 / ::ffff:127.0.0.1, which kernel mode checks instead)
#   v6.connect     nvme connect -a $ADDR6: the controller's transport address is $ADDR6
#   v6.fio         fio 4K randwrite + 128K write, crc32c verify, over that IPv6 connection
#   v6.disconnect  nvme disconnect
#   v6.stop        SIGTERM: exit status 0
#
# Env: E2E_PORT6 (default 4430), E2E_ADDR6 (default fd00:e2e::15).

PORT6=${E2E_PORT6:-4430}
ADDR6=${E2E_ADDR6:-fd00:e2e::15}
CONF6=$WORK/gateway-ipv6.toml
GWLOG6=$WORK/gateway-ipv6.log
GWPID6=""

v6_addr_up() { # $ADDR6 on eth0 (IPv6 is switched off there at boot); ::1 on lo
  local dev=eth0
  [ -e /sys/class/net/$dev ] || { ip link add e2e6 type dummy 2>/dev/null && ip link set e2e6 up; dev=e2e6; }
  echo 0 > /proc/sys/net/ipv6/conf/$dev/disable_ipv6 || { say "cannot enable IPv6 on $dev"; return 1; }
  ip -6 addr show dev $dev | grep -q "inet6 $ADDR6/" ||
    ip -6 addr add "$ADDR6/64" dev $dev nodad || { say "cannot add $ADDR6 to $dev"; return 1; }
  ip -6 addr show dev lo | grep -q 'inet6 ::1/' || { say "no ::1 on lo"; return 1; }
  say "IPv6: ::1 on lo, $ADDR6 on $dev; net.ipv6.bindv6only=$(cat /proc/sys/net/ipv6/bindv6only)"
}

v6_listening() { # a listener on [::]:$PORT6 (/proc/net/tcp6: local address all zeros)
  local hp; hp=$(printf '00000000000000000000000000000000:%04X' "$PORT6")
  awk -v hp="$hp" 'NR > 1 && $2 == hp && $4 == "0A" {f = 1} END {exit !f}' /proc/net/tcp6
}

v6_kernel_port() { # nvmet port 2: tcp, ipv6, [::]:$PORT6, same subsystem as port 1
  local p=$CFG/ports/2 s=$CFG/subsystems/$NQN
  [ -d "$s" ] || kernel_start || return 1
  mkdir $p && echo tcp > $p/addr_trtype && echo ipv6 > $p/addr_adrfam &&
    echo :: > $p/addr_traddr && echo "$PORT6" > $p/addr_trsvcid &&
    ln -s "$s" "$p/subsystems/$NQN"
}

v6_start() {
  v6_addr_up || return 1
  if [ "$MODE" = kernel ]; then
    say "kernel nvmet port on [::]:$PORT6 (--kernel-target)"
    v6_kernel_port || return 1
  else
    write_config
    # the same subsystem and namespace, one listener written as "[::]:PORT" (no port key)
    sed -e "s/^address = .*/address = \"[::]:$PORT6\"/" -e '/^port = /d' "$CONF" > "$CONF6"
    cp "$CONF6" "$LOGDIR/" 2>/dev/null
    grep -A2 '^\[\[listener\]\]' "$CONF6" | sed 's/^/    | /'
    "$GW" --config "$CONF6" >> "$GWLOG6" 2>&1 < /dev/null &
    GWPID6=$!
    say "gateway pid $GWPID6 (log $GWLOG6)"
  fi
  for _ in $(seq 150); do
    v6_listening && { say "listening on [::]:$PORT6"; return 0; }
    if [ -n "$GWPID6" ] && ! kill -0 "$GWPID6" 2>/dev/null; then
      say "gateway exited during startup: $(wait "$GWPID6"; echo "exit status $?")"; GWPID6=""
      tail -n 5 "$GWLOG6" | sed 's/^/    | /'
      return 1
    fi
    sleep 0.1
  done
  say "nothing listening on [::]:$PORT6 after 15 s"
  return 1
}

# adrfam and traddr of the NVM subsystem $NQN's entry in nvme discover's output (stdin)
v6_entry_of_nqn() {
  awk -v nqn="$NQN" '
    /^=====Discovery Log Entry/ { adrfam = ""; traddr = ""; subnqn = ""; svc = "" }
    $1 == "adrfam:" { adrfam = $2 }
    $1 == "trsvcid:" { svc = $2 }
    $1 == "subnqn:" { subnqn = $2 }
    $1 == "traddr:" { traddr = $2; if (subnqn == nqn) print adrfam, traddr, svc }'
}

v6_discover_at() { # dial-address expected-adrfam expected-traddr
  local out rc got
  out=$(timeout -k 5 60 nvme discover -t tcp -a "$1" -s "$PORT6" --hostnqn=$HOSTNQN --hostid=$HOSTID 2>&1)
  rc=$?
  [ $rc -eq 0 ] || { echo "$out" | sed 's/^/    /'; say "nvme discover -a $1 failed (rc=$rc)"; return 1; }
  echo "$out" | grep -E '^(Discovery Log|=====|trtype|adrfam|subtype|trsvcid|subnqn|traddr)' | sed "s/^/    [-a $1] /"
  got=$(echo "$out" | v6_entry_of_nqn | head -n 1)
  say "dialled $1: $NQN listed as '${got:-nothing}' (adrfam traddr trsvcid); expected '$2 $3 $PORT6'"
  [ "$got" = "$2 $3 $PORT6" ]
}

v6_discover() {
  local rc=0 mapped_fam=ipv4 mapped_addr=127.0.0.1
  # nvmet lists a dual-stack port reached over IPv4 under the port's adrfam and the
  # socket's local address as printed by %pISc (drivers/nvme/target/tcp.c)
  [ "$MODE" = kernel ] && { mapped_fam=ipv6; mapped_addr=::ffff:127.0.0.1; }
  v6_discover_at ::1 ipv6 ::1 || rc=1
  v6_discover_at "$ADDR6" ipv6 "$ADDR6" || rc=1
  if [ "$(cat /proc/sys/net/ipv6/bindv6only)" = 1 ]; then
    say "net.ipv6.bindv6only=1: [::] takes no IPv4, IPv4 dial not tried"
  else
    v6_discover_at 127.0.0.1 $mapped_fam $mapped_addr || rc=1
  fi
  return $rc
}

v6_connect() {
  local out rc ctrl taddr
  out=$(timeout -k 5 90 nvme connect -t tcp -a "$ADDR6" -s "$PORT6" --ctrl-loss-tmo=5 --reconnect-delay=1 \
    -n $NQN --hostnqn=$HOSTNQN --hostid=$HOSTID 2>&1)
  rc=$?
  [ -n "$out" ] && echo "$out" | sed 's/^/    /'
  [ $rc -eq 0 ] || { say "nvme connect -a $ADDR6 failed (rc=$rc)"; return 1; }
  DEV=$(ns_dev) || { say "connected, but no /dev/nvmeXnY for $NQN appeared within 15 s"; DEV=""; return 1; }
  ctrl=$(connected_ctrls $NQN | head -1)
  taddr=$(cat /sys/class/nvme/$ctrl/address 2>/dev/null)
  say "namespace $DEV, controller $ctrl, transport $(cat /sys/class/nvme/$ctrl/transport), address '$taddr'"
  case ",$taddr," in
    *",traddr=$ADDR6,"*) ;;
    *) say "the controller's address is not traddr=$ADDR6"; return 1 ;;
  esac
  say "$(nvme list-subsys 2>/dev/null | grep -E "tcp traddr=$ADDR6" | head -n 1 | xargs)"
}

v6_fio() {
  [ -n "$DEV" ] || { say "not connected"; return 1; }
  fio_run ipv6-randwrite-4k --rw=randwrite --bs=4k --size=8M --iodepth=16 &&
    fio_run ipv6-seqwrite-128k --rw=write --bs=128k --size=8M --iodepth=4
}

v6_stop() {
  if [ "$MODE" = kernel ]; then
    local p=$CFG/ports/2
    rm -f "$p/subsystems/$NQN" && rmdir $p
    return
  fi
  [ -n "$GWPID6" ] || { say "gateway not running"; return 1; }
  kill -0 "$GWPID6" 2>/dev/null || { wait "$GWPID6"; say "gateway had already exited (status $?)"; GWPID6=""; return 1; }
  kill -TERM "$GWPID6"
  for _ in $(seq 100); do kill -0 "$GWPID6" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$GWPID6" 2>/dev/null; then
    say "still running 10 s after SIGTERM: SIGKILL"; kill -KILL "$GWPID6"; wait "$GWPID6" 2>/dev/null; GWPID6=""; return 1
  fi
  wait "$GWPID6"; local rc=$?
  GWPID6=""
  say "gateway exited with status $rc"
  [ $rc -eq 0 ]
}

v6_cleanup() { # from e2e-tcp.sh's cleanup
  if [ -n "$GWPID6" ] && kill -0 "$GWPID6" 2>/dev/null; then kill -KILL "$GWPID6" 2>/dev/null; fi
  [ -s "$GWLOG6" ] && cp "$GWLOG6" "$LOGDIR/" 2>/dev/null
}

ipv6_steps() {
  DEV=""
  if step v6.start "target on the dual-stack wildcard [::]:$PORT6" v6_start; then
    step v6.discover "nvme discover at ::1, $ADDR6, 127.0.0.1: adrfam/traddr of the address dialled" v6_discover
    if step v6.connect "nvme connect -a $ADDR6 -s $PORT6" v6_connect; then
      step v6.fio "fio 4K randwrite + 128K write 8M each, crc32c verify, over IPv6" v6_fio
      step v6.disconnect "nvme disconnect" disconnect_nqn $NQN
    else
      skip v6.fio "connect failed"; skip v6.disconnect "connect failed"
      disconnect_nqn $NQN > /dev/null 2>&1
    fi
    step v6.stop "stop the [::] target (SIGTERM: exit status 0)" v6_stop
  else
    for s in v6.discover v6.connect v6.fio v6.disconnect v6.stop; do skip $s "the [::] target did not start"; done
    v6_cleanup
  fi
}
