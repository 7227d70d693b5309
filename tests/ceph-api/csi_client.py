#!/usr/bin/env python3
"""The calls ceph-csi's NVMe-oF driver makes to ceph-nvmeof's management API (service
`Gateway`), one CSI step per command, through a client generated from the project's own
control-plane/proto/ceph_nvmeof_gateway.proto (tests/ceph-api/make-client.sh makes it).
Each reply's errno is judged as the driver judges it (internal/nvmeof/nvmeof.go): the
statuses it takes as success pass, any other fails the command (exit 1).

usage: csi_client.py --server HOST:PORT[,HOST:PORT...] COMMAND ...
  create-volume --nqn NQN --pool POOL --image IMAGE --listener GW,ADDR,PORT ...
                prints "nsid=N uuid=UUID"
  publish       --nqn NQN --host HOSTNQN [--dhchap-key K [--dhchap-ctrlr-key K]] [--psk K]
  expand        --nqn NQN --nsid N --mib MIB
  unpublish     --nqn NQN --host HOSTNQN
  delete-volume --nqn NQN --nsid N --listener GW,ADDR,PORT ...
  bad-input     --nqn NQN --pool POOL --image IMAGE   (refusals with their errno and
                message; the listings before and after are equal)
  tls           --nqn NQN --listener GW,ADDR,PORT ... --host HOSTNQN --psk K
                NVMe/TCP TLS as ceph-csi's TLS-PSK mode sets it up (create_subsystem with
                secure_listeners, secure listeners, add_host with a PSK): the listings say
                secure / use_psk and never show the key; a malformed, an encrypted and an
                any-host PSK are refused with their errno, the listings unchanged
"""
import argparse
import errno
import sys

import grpc
from google.protobuf import json_format

import ceph_nvmeof_gateway_pb2 as pb2
import ceph_nvmeof_gateway_pb2_grpc as pb2_grpc


def connect(servers):
    """A stub on the first server that answers (ceph-csi dials one gateway address)."""
    last = None
    for server in servers.split(","):
        channel = grpc.insecure_channel(server)
        try:
            grpc.channel_ready_future(channel).result(timeout=5)
            return pb2_grpc.GatewayStub(channel)
        except grpc.FutureTimeoutError as e:
            last = e
            channel.close()
    sys.exit(f"no server of {servers} answers: {last!r}")


def call(stub, method, request, ok=(0,)):
    """One call; prints it and its status; exits when the status is not one of `ok`."""
    reply = getattr(stub, method)(request, timeout=30)
    status = reply.status
    name = errno.errorcode.get(status, str(status)) if status else "0"
    print(f"  {method} -> {name}{': ' + reply.error_message if reply.error_message else ''}")
    if status not in ok:
        sys.exit(f"{method}: status {name} is not one ceph-csi takes as success ({ok})")
    return reply


def listeners(specs):
    out = []
    for spec in specs or []:
        name, addr, port = spec.split(",")
        out.append((name, addr, int(port)))
    return out


def create_volume(stub, a):
    subs = call(stub, "list_subsystems", pb2.list_subsystems_req())
    if not any(s.nqn == a.nqn for s in subs.subsystems):
        call(stub, "create_subsystem",
             pb2.create_subsystem_req(subsystem_nqn=a.nqn, serial_number="Ceph4242424242",
                                      enable_ha=True, no_group_append=True),
             ok=(0, errno.EEXIST))
    for name, addr, port in listeners(a.listener):
        call(stub, "create_listener",
             pb2.create_listener_req(nqn=a.nqn, host_name=name, traddr=addr, trsvcid=port,
                                     adrfam=pb2.ipv4),
             ok=(0, errno.EEXIST, errno.EREMOTE))
    added = call(stub, "namespace_add",
                 pb2.namespace_add_req(subsystem_nqn=a.nqn, rbd_pool_name=a.pool,
                                       rbd_image_name=a.image, block_size=4096),
                 ok=(0, errno.EEXIST))
    nsid = added.nsid
    if added.status == errno.EEXIST:
        # ceph-csi's findExistingNamespace: match by pool and image.
        listed = call(stub, "list_namespaces", pb2.list_namespaces_req(subsystem=a.nqn))
        found = [n.nsid for n in listed.namespaces
                 if n.rbd_pool_name == a.pool and n.rbd_image_name == a.image]
        if not found:
            sys.exit(f"namespace_add said EEXIST but {a.pool}/{a.image} is not listed")
        nsid = found[0]
    one = call(stub, "list_namespaces", pb2.list_namespaces_req(subsystem=a.nqn, nsid=nsid))
    uuids = [n.uuid for n in one.namespaces if n.nsid == nsid]
    if not uuids or not uuids[0]:
        sys.exit(f"no UUID for nsid {nsid}")
    print(f"nsid={nsid} uuid={uuids[0]}")


def publish(stub, a):
    req = pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn=a.host)
    if a.dhchap_key:
        req.dhchap_key = a.dhchap_key
    if a.dhchap_ctrlr_key:
        req.dhchap_ctrlr_key = a.dhchap_ctrlr_key
    if a.psk:
        req.psk = a.psk
    call(stub, "add_host", req, ok=(0, errno.EEXIST))


def expand(stub, a):
    call(stub, "namespace_resize",
         pb2.namespace_resize_req(subsystem_nqn=a.nqn, nsid=a.nsid, new_size=a.mib))


def unpublish(stub, a):
    call(stub, "list_namespaces", pb2.list_namespaces_req(subsystem=a.nqn))
    call(stub, "remove_host", pb2.remove_host_req(subsystem_nqn=a.nqn, host_nqn=a.host),
         ok=(0, errno.ENOENT, errno.EBUSY))


def delete_volume(stub, a):
    call(stub, "namespace_delete", pb2.namespace_delete_req(subsystem_nqn=a.nqn, nsid=a.nsid),
         ok=(0, errno.ENOENT, errno.ENODEV))
    left = call(stub, "list_namespaces", pb2.list_namespaces_req(subsystem=a.nqn),
                ok=(0, errno.ENOENT))
    if left.status == 0 and left.namespaces:
        print(f"  {len(left.namespaces)} namespace(s) left: the subsystem stays")
        return
    for name, addr, port in listeners(a.listener):
        call(stub, "delete_listener",
             pb2.delete_listener_req(nqn=a.nqn, host_name=name, traddr=addr, trsvcid=port,
                                     adrfam=pb2.ipv4, force=True),
             ok=(0, errno.ENOENT))
    call(stub, "delete_subsystem", pb2.delete_subsystem_req(subsystem_nqn=a.nqn),
         ok=(0, errno.ENOENT))


def snapshot(stub, nqn):
    """What the API lists of the group and of `nqn`, to compare before and after."""
    parts = [stub.list_subsystems(pb2.list_subsystems_req(), timeout=30),
             stub.list_namespaces(pb2.list_namespaces_req(subsystem=nqn), timeout=30),
             stub.list_hosts(pb2.list_hosts_req(subsystem=nqn), timeout=30),
             stub.list_listeners(pb2.list_listeners_req(subsystem=nqn), timeout=30)]
    # `active` follows the gateways' availability, not the configuration.
    for l in parts[3].listeners:
        l.ClearField("active")
    return [json_format.MessageToDict(p) for p in parts]


def bad_input(stub, a):
    before = snapshot(stub, a.nqn)
    cases = [
        ("unknown subsystem", "namespace_add",
         pb2.namespace_add_req(subsystem_nqn=a.nqn + "-unknown", rbd_pool_name=a.pool,
                               rbd_image_name=a.image, block_size=4096),
         errno.ENOENT, "not found"),
        ("duplicate namespace", "namespace_add",
         pb2.namespace_add_req(subsystem_nqn=a.nqn, rbd_pool_name=a.pool,
                               rbd_image_name=a.image, block_size=4096),
         errno.EEXIST, "already namespace"),
        ("bad NQN", "create_subsystem",
         pb2.create_subsystem_req(subsystem_nqn="not an nqn", enable_ha=True),
         errno.EINVAL, "invalid subsystem NQN"),
        ("bad host NQN", "add_host",
         pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn="nqn.bad host"),
         errno.EINVAL, "invalid host NQN"),
        ("bad key", "add_host",
         pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn="nqn.2014-08.org.nvmexpress:bad-key",
                          dhchap_key="DHHC-1:00:AAAA:"),
         errno.EINVAL, "invalid dhchap_key"),
        ("controller key without host key", "add_host",
         pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn="nqn.2014-08.org.nvmexpress:bad-key",
                          dhchap_ctrlr_key="DHHC-1:00:AAAA:"),
         errno.EINVAL, "dhchap_ctrlr_key"),
    ]
    failed = 0
    for what, method, req, want, says in cases:
        reply = getattr(stub, method)(req, timeout=30)
        good = reply.status == want and says in reply.error_message
        failed += not good
        print(f"  {what}: {method} -> {errno.errorcode.get(reply.status, reply.status)}: "
              f"{reply.error_message} [{'ok' if good else 'expected ' + errno.errorcode[want] + ', ' + repr(says)}]")
    after = snapshot(stub, a.nqn)
    if after != before:
        print(f"  the state changed:\n    before {before}\n    after  {after}")
        failed += 1
    else:
        print("  listings unchanged")
    if failed:
        sys.exit(f"{failed} bad-input check(s) failed")


def tls(stub, a):
    call(stub, "create_subsystem",
         pb2.create_subsystem_req(subsystem_nqn=a.nqn, serial_number="Ceph4242424243",
                                  enable_ha=True, no_group_append=True, secure_listeners=True),
         ok=(0, errno.EEXIST))
    wanted = listeners(a.listener)
    for name, addr, port in wanted:
        call(stub, "create_listener",
             pb2.create_listener_req(nqn=a.nqn, host_name=name, traddr=addr, trsvcid=port,
                                     adrfam=pb2.ipv4, secure=True),
             ok=(0, errno.EEXIST, errno.EREMOTE))
    call(stub, "add_host", pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn=a.host, psk=a.psk),
         ok=(0, errno.EEXIST))
    failed = 0
    listed = call(stub, "list_listeners", pb2.list_listeners_req(subsystem=a.nqn))
    secure = {(l.host_name, l.traddr, l.trsvcid): l.secure for l in listed.listeners}
    for key in wanted:
        if secure.get(key) is not True:
            print(f"  listener {key}: secure {secure.get(key)!r}, expected True")
            failed += 1
    hosts = call(stub, "list_hosts", pb2.list_hosts_req(subsystem=a.nqn))
    use_psk = {h.nqn: h.use_psk for h in hosts.hosts}
    if use_psk.get(a.host) is not True:
        print(f"  host {a.host}: use_psk {use_psk.get(a.host)!r}, expected True")
        failed += 1
    subs = call(stub, "list_subsystems", pb2.list_subsystems_req(subsystem_nqn=a.nqn))
    shown = str(snapshot(stub, a.nqn)) + str(json_format.MessageToDict(subs))
    # The base64 part of the key (between "NVMeTLSkey-1:HH:" and the last ':').
    if a.psk[16:-1] in shown:
        print("  a listing shows the PSK")
        failed += 1
    print(f"  listeners secure: {sorted(secure.items())}; hosts use_psk: {sorted(use_psk.items())}")

    before = snapshot(stub, a.nqn)
    other = "nqn.2014-08.org.nvmexpress:tls-refused"
    cases = [
        ("malformed PSK", pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn=other,
                                           psk="NVMeTLSkey-1:01:AAAA:"),
         errno.EINVAL, "invalid psk"),
        ("encrypted PSK", pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn=other, psk=a.psk,
                                           psk_encrypted=True),
         errno.EOPNOTSUPP, "encrypted keys"),
        ("PSK for any host", pb2.add_host_req(subsystem_nqn=a.nqn, host_nqn="*", psk=a.psk),
         errno.EINVAL, "any host"),
        ("PSK on an unknown subsystem", pb2.add_host_req(subsystem_nqn=a.nqn + "-unknown",
                                                         host_nqn=other, psk=a.psk),
         errno.ENOENT, "not found"),
    ]
    for what, req, want, says in cases:
        reply = stub.add_host(req, timeout=30)
        good = (reply.status == want and says in reply.error_message
                and a.psk[16:-1] not in reply.error_message)
        failed += not good
        print(f"  {what}: add_host -> {errno.errorcode.get(reply.status, reply.status)}: "
              f"{reply.error_message} [{'ok' if good else 'expected ' + errno.errorcode[want] + ', ' + repr(says)}]")
    if snapshot(stub, a.nqn) != before:
        print("  a refusal changed the listings")
        failed += 1
    else:
        print("  listings unchanged by the refusals")
    if failed:
        sys.exit(f"{failed} TLS check(s) failed")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", required=True)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("create-volume", "publish", "expand", "unpublish", "delete-volume",
                 "bad-input", "tls"):
        c = sub.add_parser(name)
        c.add_argument("--nqn", required=True)
        if name in ("create-volume", "bad-input"):
            c.add_argument("--pool", required=True)
            c.add_argument("--image", required=True)
        if name in ("create-volume", "delete-volume", "tls"):
            c.add_argument("--listener", action="append")
        if name in ("publish", "unpublish", "tls"):
            c.add_argument("--host", required=True)
        if name == "publish":
            c.add_argument("--dhchap-key")
            c.add_argument("--dhchap-ctrlr-key")
            c.add_argument("--psk")
        if name == "tls":
            c.add_argument("--psk", required=True)
        if name in ("expand", "delete-volume"):
            c.add_argument("--nsid", type=int, required=True)
        if name == "expand":
            c.add_argument("--mib", type=int, required=True)
    a = p.parse_args()
    stub = connect(a.server)
    {"create-volume": create_volume, "publish": publish, "expand": expand,
     "unpublish": unpublish, "delete-volume": delete_volume,
     "bad-input": bad_input, "tls": tls}[a.cmd](stub, a)


if __name__ == "__main__":
    main()
