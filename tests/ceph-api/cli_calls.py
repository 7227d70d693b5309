#!/usr/bin/env python3
"""The calls ceph-nvmeof's CLI and the Ceph dashboard make beyond ceph-csi's, through a client
generated from the project's own control-plane/proto/ceph_nvmeof_gateway.proto
(tests/ceph-api/make-client.sh makes it): the gateway's version, log levels, listener status,
the subsystem's DH-HMAC-CHAP key, load-balancing group, visibility, trash on delete,
auto-resize, get_subsystems, the images' sizes, and the SPDK calls answered EOPNOTSUPP. Each
check prints a line; bad input must answer its errno and message and leave the listings as
they were. Exit 1 when a check fails.

usage: cli_calls.py --server HOST:PORT --nqn NQN --listener-gateway GW --lb-groups A,B
  (the group's gateways own load-balancing groups A and B; GW listens on 127.0.0.1:4420)
"""
import argparse
import base64
import errno
import os
import sys
import zlib

import grpc
from google.protobuf import json_format

import ceph_nvmeof_gateway_pb2 as pb2
import ceph_nvmeof_gateway_pb2_grpc as pb2_grpc

GIB = 1 << 30
failed = 0


def check(what, good, detail=""):
    global failed
    failed += not good
    print(f"  {what}: {'ok' if good else 'FAILED'}{' (' + detail + ')' if detail else ''}")


def status(stub, method, request, want=0, says=""):
    """One call; checks its errno (and that its message says `says`)."""
    reply = getattr(stub, method)(request, timeout=30)
    name = errno.errorcode.get(reply.status, str(reply.status)) if reply.status else "0"
    check(f"{method} -> {name}", reply.status == want and says in reply.error_message,
          reply.error_message if reply.error_message else "")
    return reply


def dhchap_key():
    """A key as `nvme gen-dhchap-key` prints it: 32 random bytes and their CRC-32."""
    k = os.urandom(32)
    return "DHHC-1:00:" + base64.b64encode(k + zlib.crc32(k).to_bytes(4, "little")).decode() + ":"


def snapshot(stub, nqn):
    parts = [stub.list_subsystems(pb2.list_subsystems_req(), timeout=30),
             stub.list_namespaces(pb2.list_namespaces_req(subsystem=nqn), timeout=30),
             stub.list_hosts(pb2.list_hosts_req(subsystem=nqn), timeout=30),
             stub.get_gateway_log_level(pb2.get_gateway_log_level_req(), timeout=30)]
    return [json_format.MessageToDict(p) for p in parts]


def unchanged(stub, nqn, before, what):
    check(f"{what}: listings unchanged", snapshot(stub, nqn) == before)


def namespace(stub, nqn, nsid):
    listed = stub.list_namespaces(pb2.list_namespaces_req(subsystem=nqn, nsid=nsid), timeout=30)
    return listed.namespaces[0] if listed.namespaces else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--nqn", required=True)
    p.add_argument("--listener-gateway", required=True)
    p.add_argument("--lb-groups", required=True)
    a = p.parse_args()
    group_a, group_b = (int(g) for g in a.lb_groups.split(","))
    stub = pb2_grpc.GatewayStub(grpc.insecure_channel(a.server))
    nqn, unknown = a.nqn, a.nqn + "-unknown"

    print("version")
    info = stub.get_gateway_info(pb2.get_gateway_info_req(cli_version="1.5.4"), timeout=30)
    parts = info.version.split(".")
    check("version is X.Y.Z >= 1.1.0 (what ceph-nvmeof's CLI requires)",
          len(parts) == 3 and all(x.isdigit() for x in parts)
          and tuple(int(x) for x in parts) >= (1, 1, 0), info.version)
    check("this project's version in the message", "ceph-nvmeof-rs" in info.error_message,
          info.error_message)
    check("cli_version echoed", info.cli_version == "1.5.4")

    print("setup")
    status(stub, "create_subsystem", pb2.create_subsystem_req(subsystem_nqn=nqn, enable_ha=True))
    status(stub, "create_listener",
           pb2.create_listener_req(nqn=nqn, host_name=a.listener_gateway, traddr="127.0.0.1",
                                   trsvcid=4420, adrfam=pb2.ipv4))
    added = status(stub, "namespace_add",
                   pb2.namespace_add_req(subsystem_nqn=nqn, rbd_pool_name="rbd",
                                         rbd_image_name="cli-calls", create_image=True,
                                         size=GIB, anagrpid=group_a))
    nsid = added.nsid

    print("rbd_image_size")
    check("the image's size", namespace(stub, nqn, nsid).rbd_image_size == GIB)
    status(stub, "namespace_resize",
           pb2.namespace_resize_req(subsystem_nqn=nqn, nsid=nsid, new_size=2048))
    check("its size after a resize", namespace(stub, nqn, nsid).rbd_image_size == 2 * GIB)

    print("load-balancing group")
    status(stub, "namespace_change_load_balancing_group",
           pb2.namespace_change_load_balancing_group_req(subsystem_nqn=nqn, nsid=nsid,
                                                         anagrpid=group_b))
    check("moved", namespace(stub, nqn, nsid).load_balancing_group == group_b)
    before = snapshot(stub, nqn)
    status(stub, "namespace_change_load_balancing_group",
           pb2.namespace_change_load_balancing_group_req(subsystem_nqn=nqn, nsid=nsid,
                                                         anagrpid=97),
           errno.ENODEV, "ANA group 97 has no gateway")
    status(stub, "namespace_change_load_balancing_group",
           pb2.namespace_change_load_balancing_group_req(subsystem_nqn=nqn, nsid=99,
                                                         anagrpid=group_a),
           errno.ENODEV, "namespace 99 not found")
    status(stub, "namespace_change_load_balancing_group",
           pb2.namespace_change_load_balancing_group_req(subsystem_nqn=unknown, nsid=nsid,
                                                         anagrpid=group_a),
           errno.ENOENT, "not found")
    unchanged(stub, nqn, before, "bad load-balancing groups")

    print("visibility")
    host = "nqn.2014-08.org.nvmexpress:uuid:cli-calls-host"
    status(stub, "namespace_change_visibility",
           pb2.namespace_change_visibility_req(subsystem_nqn=nqn, nsid=nsid, auto_visible=False))
    check("visible to listed hosts only", not namespace(stub, nqn, nsid).auto_visible)
    status(stub, "namespace_add_host",
           pb2.namespace_add_host_req(subsystem_nqn=nqn, nsid=nsid, host_nqn=host))
    before = snapshot(stub, nqn)
    status(stub, "namespace_change_visibility",
           pb2.namespace_change_visibility_req(subsystem_nqn=nqn, nsid=nsid, auto_visible=True),
           errno.EBUSY, "host(s) on its list")
    status(stub, "namespace_change_visibility",
           pb2.namespace_change_visibility_req(subsystem_nqn=nqn, nsid=99, auto_visible=True),
           errno.ENODEV, "not found")
    unchanged(stub, nqn, before, "refused visibility changes")
    status(stub, "namespace_change_visibility",
           pb2.namespace_change_visibility_req(subsystem_nqn=nqn, nsid=nsid, auto_visible=True,
                                               force=True))
    ns = namespace(stub, nqn, nsid)
    check("visible to every host again, list dropped", ns.auto_visible and not ns.hosts)

    print("auto-resize")
    status(stub, "namespace_set_auto_resize",
           pb2.namespace_set_auto_resize_req(subsystem_nqn=nqn, nsid=nsid, auto_resize=True))
    check("auto-resize on by default", not namespace(stub, nqn, nsid).disable_auto_resize)
    status(stub, "namespace_set_auto_resize",
           pb2.namespace_set_auto_resize_req(subsystem_nqn=nqn, nsid=nsid, auto_resize=False))
    check("auto-resize off listed", namespace(stub, nqn, nsid).disable_auto_resize)
    before = snapshot(stub, nqn)
    status(stub, "namespace_set_auto_resize",
           pb2.namespace_set_auto_resize_req(subsystem_nqn=nqn, nsid=nsid + 1000,
                                             auto_resize=True),
           errno.ENODEV)
    unchanged(stub, nqn, before, "auto-resize of an unknown namespace")
    status(stub, "namespace_set_auto_resize",
           pb2.namespace_set_auto_resize_req(subsystem_nqn=nqn, nsid=nsid, auto_resize=True))
    check("auto-resize on again", not namespace(stub, nqn, nsid).disable_auto_resize)

    print("subsystem key")
    status(stub, "add_host", pb2.add_host_req(subsystem_nqn=nqn, host_nqn=host,
                                              dhchap_key=dhchap_key()))
    before = snapshot(stub, nqn)
    status(stub, "change_subsystem_key",
           pb2.change_subsystem_key_req(subsystem_nqn=nqn, dhchap_key="DHHC-1:00:AAAA:"),
           errno.EINVAL, "invalid dhchap_key")
    status(stub, "change_subsystem_key",
           pb2.change_subsystem_key_req(subsystem_nqn=unknown, dhchap_key=dhchap_key()),
           errno.ENOENT, "not found")
    unchanged(stub, nqn, before, "refused subsystem keys")
    key = dhchap_key()
    status(stub, "change_subsystem_key",
           pb2.change_subsystem_key_req(subsystem_nqn=nqn, dhchap_key=key))
    subs = stub.list_subsystems(pb2.list_subsystems_req(subsystem_nqn=nqn), timeout=30)
    check("has_dhchap_key", subs.subsystems[0].has_dhchap_key)
    hosts = stub.list_hosts(pb2.list_hosts_req(subsystem=nqn), timeout=30)
    check("the host's controller key is the subsystem's",
          hosts.hosts[0].dhchap_controller_origin == pb2.subsystem_implicit)
    shown = str(snapshot(stub, nqn)) + str(json_format.MessageToDict(
        stub.get_subsystems(pb2.get_subsystems_req(), timeout=30)))
    check("no listing shows the key", key[10:-1] not in shown)
    status(stub, "change_subsystem_key", pb2.change_subsystem_key_req(subsystem_nqn=nqn))
    subs = stub.list_subsystems(pb2.list_subsystems_req(subsystem_nqn=nqn), timeout=30)
    check("key removed", not subs.subsystems[0].has_dhchap_key)

    print("get_subsystems")
    got = stub.get_subsystems(pb2.get_subsystems_req(), timeout=30)
    mine = [s for s in got.subsystems if s.nqn == nqn]
    check("the subsystem with its listener, host and namespace",
          len(mine) == 1 and [l.traddr for l in mine[0].listen_addresses] == ["127.0.0.1"]
          and [h.nqn for h in mine[0].hosts] == [host]
          and [n.nsid for n in mine[0].namespaces] == [nsid])

    print("listener status")
    li = status(stub, "show_gateway_listeners_info",
                pb2.show_gateway_listeners_info_req(subsystem_nqn=nqn))
    states = {(s.grp_id, s.state) for l in li.gw_listeners for s in l.lb_states}
    check(f"{a.listener_gateway} optimized for its group {group_a}",
          (group_a, pb2.OPTIMIZED) in states, str(sorted(states)))
    status(stub, "show_gateway_listeners_info",
           pb2.show_gateway_listeners_info_req(subsystem_nqn=unknown), errno.ENOENT, "not found")

    print("log level")
    status(stub, "set_gateway_log_level", pb2.set_gateway_log_level_req(log_level=pb2.warning))
    lvl = stub.get_gateway_log_level(pb2.get_gateway_log_level_req(), timeout=30)
    check("get answers warning", lvl.status == 0 and lvl.log_level == pb2.warning)
    before = snapshot(stub, nqn)
    status(stub, "set_gateway_log_level", pb2.set_gateway_log_level_req(log_level=15),
           errno.ENOKEY, "Unknown log level 15")
    status(stub, "set_gateway_log_level", pb2.set_gateway_log_level_req(log_level=pb2.notset),
           errno.EINVAL, "notset")
    unchanged(stub, nqn, before, "refused log levels")
    status(stub, "set_gateway_log_level", pb2.set_gateway_log_level_req(log_level=pb2.info))

    print("SPDK and monitor calls")
    status(stub, "get_spdk_nvmf_log_flags_and_level",
           pb2.get_spdk_nvmf_log_flags_and_level_req(), errno.EOPNOTSUPP, "no SPDK")
    status(stub, "set_spdk_nvmf_logs", pb2.set_spdk_nvmf_logs_req(), errno.EOPNOTSUPP, "no SPDK")
    status(stub, "disable_spdk_nvmf_logs", pb2.disable_spdk_nvmf_logs_req(), errno.EOPNOTSUPP,
           "no SPDK")
    status(stub, "set_ana_state", pb2.ana_info(), errno.EOPNOTSUPP, "set_ana_state")

    print("trash on delete")
    status(stub, "namespace_set_rbd_trash_image",
           pb2.namespace_set_rbd_trash_image_req(subsystem_nqn=nqn, nsid=nsid, trash_image=True))
    check("listed", namespace(stub, nqn, nsid).trash_image)
    before = snapshot(stub, nqn)
    status(stub, "namespace_delete", pb2.namespace_delete_req(subsystem_nqn=nqn, nsid=nsid),
           errno.EINVAL, "i_am_sure")
    unchanged(stub, nqn, before, "an unconfirmed delete")
    status(stub, "namespace_delete",
           pb2.namespace_delete_req(subsystem_nqn=nqn, nsid=nsid, i_am_sure=True))
    check("namespace gone", namespace(stub, nqn, nsid) is None)

    status(stub, "delete_subsystem", pb2.delete_subsystem_req(subsystem_nqn=nqn, force=True))
    if failed:
        sys.exit(f"{failed} check(s) failed")
    print("all checks passed")


if __name__ == "__main__":
    main()
