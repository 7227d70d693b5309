# shellcheck shell=bash
# tests/vm/tenants/csi.sh - the e2e-tenants part "csi": ceph-csi's NVMe-oF driver's sequence
# through ceph-nvmeof's management API (control-plane/proto/ceph_nvmeof_gateway.proto, served
# by nvmeof-control next to its Admin API), with the real Linux host of the guest as the CSI
# node. The API client is tests/ceph-api/csi_client.py in the venv tests/ceph-api/make-client.sh
# made on the host (${CEPH_API_VENV:-/root/.cache/nvmeof-ceph-api-venv}, run here from the
# host's read-only root). Steps:
#   csi.client     the venv and the client generated from the project's proto are there
#   csi.create     CreateVolume on an RBD image made for it: list_subsystems, create_subsystem,
#                  create_listener for gw1 and gw2, namespace_add (4096-byte blocks),
#                  list_namespaces -> NSID and UUID; run twice, the same NSID and UUID
#   csi.badinput   unknown subsystem, duplicate namespace, bad NQNs, bad keys: the errno and
#                  message, listings unchanged
#   csi.publish    ControllerPublish: add_host; NodeStage: nvme connect to both gateways;
#                  udev makes /dev/disk/by-id/nvme-uuid.<UUID from list_namespaces>
#   csi.fio        fio --verify through that path
#   csi.expand     ControllerExpand: namespace_resize to 128 MiB; the host sees the new size
#   csi.unpublish  NodeUnstage (disconnect), ControllerUnpublish: list_namespaces, remove_host;
#                  a new connect is refused: the host lost access
#   csi.delete     DeleteVolume: namespace_delete, delete_listener (force), delete_subsystem;
#                  the image removed; the subsystem is gone from nvmeofctl's list
# The part's own names: subsystem nqn.2016-06.io.ceph-nvmeof-rs:tenants-csi, host
# nqn.2014-08.org.nvmexpress:csi-node-e2e (as ceph-csi names a node), image csi-vol1.

CSI_NQN=nqn.2016-06.io.ceph-nvmeof-rs:tenants-csi
CSI_HOST=nqn.2014-08.org.nvmexpress:csi-node-e2e
CSI_HOSTID=5c5c5c5c-0000-4000-8000-00000000c515
CSI_IMAGE=csi-vol1
CSI_VENV=${CEPH_API_VENV:-/root/.cache/nvmeof-ceph-api-venv}
CSI_NSID="" CSI_UUID="" CSI_UDEVD=""

csi_client() { # COMMAND ARGS...: tests/ceph-api/csi_client.py against the control plane
  PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$CSI_VENV/gen timeout -k 5 120 "$CSI_VENV/bin/python" \
    "$HERE/../ceph-api/csi_client.py" --server "$CTL_SERVERS" "$@"
}
csi_listeners() {
  echo --listener "gw1,127.0.0.1,${PORTS[0]}" --listener "gw2,127.0.0.1,${PORTS[1]}"
}

csi_check_client() {
  [ -x "$CSI_VENV/bin/python" ] || { say "no venv at $CSI_VENV: run tests/ceph-api/make-client.sh on the host first"; return 1; }
  PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$CSI_VENV/gen "$CSI_VENV/bin/python" -c \
    'import grpc, ceph_nvmeof_gateway_pb2_grpc; print("    grpcio", grpc.__version__)'
}

csi_create() {
  local out again
  # shellcheck disable=SC2046  # the listener options are words
  out=$(csi_client create-volume --nqn "$CSI_NQN" --pool rbd --image "$CSI_IMAGE" $(csi_listeners)) ||
    { echo "$out" | sed 's/^/  /'; return 1; }
  echo "$out" | sed 's/^/  /'
  CSI_NSID=$(sed -n 's/^nsid=\([0-9]*\) uuid=.*/\1/p' <<< "$out")
  CSI_UUID=$(sed -n 's/^nsid=[0-9]* uuid=\(.*\)/\1/p' <<< "$out")
  [ -n "$CSI_NSID" ] && [ -n "$CSI_UUID" ] || { say "no nsid/uuid in the output"; return 1; }
  say "CreateVolume again (a retried CSI call):"
  # shellcheck disable=SC2046
  again=$(csi_client create-volume --nqn "$CSI_NQN" --pool rbd --image "$CSI_IMAGE" $(csi_listeners)) ||
    { echo "$again" | sed 's/^/  /'; return 1; }
  echo "$again" | sed 's/^/  /'
  [ "$(tail -n 1 <<< "$again")" = "nsid=$CSI_NSID uuid=$CSI_UUID" ] ||
    { say "the retry gave another namespace"; return 1; }
}

csi_start_udev() { # the guest runs no udev: start one for the by-id links ceph-csi's node uses
  mkdir -p /run/udev
  /lib/systemd/systemd-udevd > "$LOGDIR/csi-udevd.log" 2>&1 &
  CSI_UDEVD=$!
  for _ in $(seq 50); do udevadm control --ping 2>/dev/null && return 0; sleep 0.1; done
  say "systemd-udevd did not start: $(tail -n 3 "$LOGDIR/csi-udevd.log")"; return 1
}
csi_stop_udev() {
  [ -n "$CSI_UDEVD" ] || return 0
  udevadm control --exit 2>/dev/null || kill "$CSI_UDEVD" 2>/dev/null
  wait "$CSI_UDEVD" 2>/dev/null; CSI_UDEVD=""
}

csi_connect() { # PORT: as ceph-csi's node connects (ctrl-loss-tmo 1800)
  timeout -k 5 60 nvme connect -t tcp -a "$ADDR" -s "$1" -n "$CSI_NQN" --hostnqn="$CSI_HOST" \
    --hostid="$CSI_HOSTID" -l 1800 2>&1 | sed 's/^/    /'
  return "${PIPESTATUS[0]}"
}

csi_publish() {
  local out link dev wwid
  out=$(csi_client publish --nqn "$CSI_NQN" --host "$CSI_HOST") || { echo "$out" | sed 's/^/  /'; return 1; }
  echo "$out" | sed 's/^/  /'
  csi_connect "${PORTS[0]}" && csi_connect "${PORTS[1]}" || return 1
  csi_start_udev || return 1
  NQN=$CSI_NQN
  dev=$(ns_dev "$CSI_NSID") || { say "no block device for nsid $CSI_NSID"; return 1; }
  wwid=$(cat "/sys/block/${dev#/dev/}/wwid")
  say "$dev: wwid $wwid, paths: $(connected_ctrls "$CSI_NQN" | tr '\n' ' ')"
  udevadm trigger --action=add --subsystem-match=block 2>&1 | sed 's/^/    /'
  udevadm settle --timeout=20
  link=/dev/disk/by-id/nvme-uuid.$CSI_UUID
  [ -e "$link" ] || { say "no $link; by-id: $(ls /dev/disk/by-id 2>&1 | tr '\n' ' ')"; return 1; }
  [ "$(readlink -f "$link")" = "$dev" ] || { say "$link -> $(readlink -f "$link"), not $dev"; return 1; }
  say "$link -> $dev"
  [ "$(cat "/sys/block/${dev#/dev/}/queue/logical_block_size")" = 4096 ] ||
    { say "logical block size $(cat "/sys/block/${dev#/dev/}/queue/logical_block_size"), not 4096"; return 1; }
}

csi_fio() {
  DEV=/dev/disk/by-id/nvme-uuid.$CSI_UUID
  fio_run csi --rw=randwrite --bs=4k --size=8M --iodepth=8
}

csi_expand() {
  local out dev bytes
  out=$(csi_client expand --nqn "$CSI_NQN" --nsid "$CSI_NSID" --mib 128) || { echo "$out" | sed 's/^/  /'; return 1; }
  echo "$out" | sed 's/^/  /'
  dev=$(readlink -f "/dev/disk/by-id/nvme-uuid.$CSI_UUID")
  for _ in $(seq 200); do
    bytes=$(( $(cat "/sys/block/${dev#/dev/}/size") * 512 ))
    [ "$bytes" = $((128 << 20)) ] && { say "$dev is $bytes bytes"; return 0; }
    sleep 0.1
  done
  say "$dev is $bytes bytes after 20 s, not $((128 << 20))"; return 1
}

csi_unpublish() {
  local out
  disconnect_nqn "$CSI_NQN" || return 1
  # The gateways' next beacons (every 250 ms) tell the control plane the node is gone.
  sleep 1
  out=$(csi_client unpublish --nqn "$CSI_NQN" --host "$CSI_HOST") || { echo "$out" | sed 's/^/  /'; return 1; }
  echo "$out" | sed 's/^/  /'
  if csi_connect "${PORTS[0]}"; then
    say "the node connected after unpublish"; delete_ctrls "$CSI_NQN"; return 1
  fi
  say "connect refused: the node lost access"
  [ -z "$(connected_ctrls "$CSI_NQN")" ]
}

csi_delete() {
  local out
  # shellcheck disable=SC2046
  out=$(csi_client delete-volume --nqn "$CSI_NQN" --nsid "$CSI_NSID" $(csi_listeners)) ||
    { echo "$out" | sed 's/^/  /'; return 1; }
  echo "$out" | sed 's/^/  /'
  ask 60 rbd-rm "$CSI_IMAGE" || return 1
  if ctl subsystem list | grep -qF "$CSI_NQN"; then say "$CSI_NQN still listed"; return 1; fi
}

csi_cleanup() { # whatever failed: nothing of this part left behind
  csi_stop_udev
  delete_ctrls "$CSI_NQN"
  ctl subsystem del -n "$CSI_NQN" --force > /dev/null 2>&1
  ask 60 rbd-rm "$CSI_IMAGE" > /dev/null 2>&1
  return 0
}

tenant_csi() {
  local done_delete=0
  if step csi.client "the API client generated from the project's proto (venv from the host)" csi_check_client &&
     step csi.image "an RBD image for the volume (rbd-create $CSI_IMAGE 64 MiB)" ask 60 rbd-create "$CSI_IMAGE" 64 &&
     step csi.create "CreateVolume: subsystem, listeners gw1+gw2, namespace_add 4K, uuid; retried: same" csi_create; then
    step csi.badinput "bad input: errno + message, listings unchanged" csi_client bad-input --nqn "$CSI_NQN" --pool rbd --image "$CSI_IMAGE"
    if step csi.publish "ControllerPublish add_host + connect: /dev/disk/by-id/nvme-uuid.<uuid>" csi_publish; then
      step csi.fio "fio --verify on /dev/disk/by-id/nvme-uuid.$CSI_UUID" csi_fio
      step csi.expand "ControllerExpand namespace_resize 128 MiB: the host sees it" csi_expand
    else
      skip csi.fio "not published"; skip csi.expand "not published"
    fi
    step csi.unpublish "NodeUnstage + ControllerUnpublish remove_host: connect refused" csi_unpublish
    step csi.delete "DeleteVolume: namespace_delete, delete_listener, delete_subsystem" csi_delete && done_delete=1
  fi
  csi_stop_udev
  [ $done_delete = 1 ] || csi_cleanup
}
