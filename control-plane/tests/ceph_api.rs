//! ceph-nvmeof's management API (`proto/ceph_nvmeof_gateway.proto`) over the wire, with a
//! tonic client generated from that file, against a replica with its state in memory: the
//! sequence ceph-csi's NVMe-oF driver runs (create volume, publish, unpublish, expand,
//! delete) with the errno statuses it treats as success, the refusals of bad input (errno and
//! message, state unchanged), the options answered EOPNOTSUPP, and the service behind the
//! same mTLS as the Admin API.

use std::sync::Arc;
use std::time::Duration;

use control_plane::ana::Timing;
use control_plane::ceph_proto as pb;
use control_plane::ceph_proto::gateway_client::GatewayClient;
use control_plane::proto;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::server::{ControlPlane, Options};
use control_plane::state::{self, GroupState};
use control_plane::store::{MemoryBackend, Store};
use control_plane::test_support::{self, plain_channel, serve_in_memory_over_tls, TestPki};
use control_plane::tls;
use tonic::transport::Channel;

const NQN: &str = "nqn.2016-06.io.test:csi";
const NODE: &str = "nqn.2014-08.org.nvmexpress:node-1";
const GIB: u64 = 1 << 30;

// errno values, Linux include/uapi/asm-generic/errno-base.h and errno.h.
const ENOENT: i32 = 2;
const EBUSY: i32 = 16;
const EEXIST: i32 = 17;
const ENODEV: i32 = 19;
const EINVAL: i32 = 22;
const EREMOTE: i32 = 66;
const EOPNOTSUPP: i32 = 95;

struct Fixture {
    backend: Arc<MemoryBackend>,
    cp: Arc<ControlPlane>,
    gw: GatewayClient<Channel>,
    control: GatewayControlClient<Channel>,
}

async fn start() -> Fixture {
    let backend =
        test_support::memory_backend_with_images(["rbd/img1", "rbd/img2"].map(String::from));
    let options = Options {
        timing: Timing {
            grace_ms: 5_000,
            failback_delay_ms: 200,
        },
        lease: Duration::from_secs(3),
        tick: Duration::from_millis(50),
    };
    let cp = test_support::start_replica(Store::new(backend.clone()), "csi-test", options).await;
    let addr = test_support::serve_plain(cp.clone()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(5)).await;
    let mut control = GatewayControlClient::new(plain_channel(&addr).await);
    beacon(&mut control, &[]).await;
    Fixture {
        backend,
        cp,
        gw: GatewayClient::new(plain_channel(&addr).await),
        control,
    }
}

/// A beacon of gateway gw1 (ANA group 1) with these hosts connected to NQN (without TLS).
async fn beacon(c: &mut GatewayControlClient<Channel>, hosts: &[&str]) {
    let plain: Vec<(&str, bool)> = hosts.iter().map(|h| (*h, false)).collect();
    beacon_tls(c, &plain).await;
}

/// A beacon of gateway gw1 with these hosts connected to NQN, each over TLS or not.
async fn beacon_tls(c: &mut GatewayControlClient<Channel>, hosts: &[(&str, bool)]) {
    c.send_beacon(proto::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 1,
        client_addrs: vec!["127.0.0.1:0/1".into()],
        applied_version: 0,
        connections: hosts
            .iter()
            .enumerate()
            .map(|(i, (h, secure))| proto::Connection {
                gateway: String::new(),
                subsystem_nqn: NQN.into(),
                host_nqn: h.to_string(),
                cntlid: 1 + i as u32,
                io_queues: 2,
                secure: *secure,
            })
            .collect(),
        cluster: 0,
        osds_unanswered: vec![],
        osd_probe: None,
    })
    .await
    .expect("beacon");
}

fn subsystem_req(nqn: &str) -> pb::CreateSubsystemReq {
    // As ceph-csi sends it.
    pb::CreateSubsystemReq {
        subsystem_nqn: nqn.into(),
        serial_number: "Ceph12345678901234".into(),
        enable_ha: true,
        no_group_append: Some(true),
        ..Default::default()
    }
}

fn listener_req(host_name: &str) -> pb::CreateListenerReq {
    pb::CreateListenerReq {
        nqn: NQN.into(),
        host_name: host_name.into(),
        traddr: "127.0.0.1".into(),
        trsvcid: Some(4420),
        adrfam: Some(pb::AddressFamily::Ipv4 as i32),
        ..Default::default()
    }
}

fn namespace_req(image: &str, block_size: u32) -> pb::NamespaceAddReq {
    pb::NamespaceAddReq {
        subsystem_nqn: NQN.into(),
        rbd_pool_name: "rbd".into(),
        rbd_image_name: image.into(),
        block_size,
        ..Default::default()
    }
}

/// A TLS PSK as `nvme gen-tls-key` prints it.
fn psk(byte: u8) -> String {
    nvme_auth::tls_psk::ConfiguredPsk::from_bytes(&[byte; 32], None)
        .expect("32 bytes")
        .to_interchange()
        .to_string()
}

fn key(byte: u8) -> String {
    nvme_auth::DhchapSecret::from_bytes(&[byte; 32], None)
        .expect("32 bytes")
        .to_representation()
        .to_string()
}

/// The state without its version: what a refused request must leave as it was.
fn config(cp: &ControlPlane) -> GroupState {
    let mut st = cp.state();
    st.map = None;
    st
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ceph_csi_volume_lifecycle() {
    let mut f = start().await;
    let gw = &mut f.gw;

    // CreateVolume: the subsystem when list_subsystems lacks it (EEXIST is fine too).
    let listed = gw
        .list_subsystems(pb::ListSubsystemsReq::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!((listed.status, listed.subsystems.len()), (0, 0));
    let created = gw
        .create_subsystem(subsystem_req(NQN))
        .await
        .expect("create")
        .into_inner();
    assert_eq!(
        (created.status, created.nqn.as_str()),
        (0, NQN),
        "{created:?}"
    );
    let again = gw
        .create_subsystem(subsystem_req(NQN))
        .await
        .expect("again");
    assert_eq!(again.get_ref().status, EEXIST);
    let listed = gw
        .list_subsystems(pb::ListSubsystemsReq::default())
        .await
        .expect("list")
        .into_inner();
    let s = &listed.subsystems[0];
    assert_eq!(
        (s.nqn.as_str(), s.serial_number.as_str(), s.enable_ha),
        (NQN, "Ceph12345678901234", true)
    );
    assert_eq!(s.allow_any_host, Some(false), "closed until add_host");
    assert_eq!(s.max_namespaces, state::DEFAULT_MAX_NAMESPACES);

    // A listener on the gateway gw1 (in the group), then one for a gateway not in it yet.
    let l = gw
        .create_listener(listener_req("gw1"))
        .await
        .expect("listener");
    assert_eq!(l.get_ref().status, 0, "{:?}", l.get_ref());
    let l = gw
        .create_listener(listener_req("gw1"))
        .await
        .expect("again");
    assert_eq!(l.get_ref().status, EEXIST);
    let stashed = gw.create_listener(listener_req("gw9")).await.expect("gw9");
    assert_eq!(stashed.get_ref().status, EREMOTE, "{:?}", stashed.get_ref());
    assert!(stashed.get_ref().error_message.contains("gw9"));
    let listeners = gw
        .list_listeners(pb::ListListenersReq {
            subsystem: NQN.into(),
        })
        .await
        .expect("listeners")
        .into_inner();
    let mut seen: Vec<(String, Option<bool>)> = listeners
        .listeners
        .iter()
        .map(|l| (l.host_name.clone(), l.active))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("gw1".to_string(), Some(true)),
            ("gw9".to_string(), Some(false))
        ]
    );
    assert_eq!(listeners.listeners[0].trtype, "TCP");
    assert_eq!(listeners.listeners[0].trsvcid, 4420);

    // The namespace (4096-byte blocks, as ceph-csi asks), then the same image again: EEXIST,
    // and ceph-csi finds it by pool and image in list_namespaces.
    let added = gw
        .namespace_add(namespace_req("img1", 4096))
        .await
        .expect("add")
        .into_inner();
    assert_eq!((added.status, added.nsid), (0, 1), "{added:?}");
    let dup = gw
        .namespace_add(namespace_req("img1", 4096))
        .await
        .expect("dup")
        .into_inner();
    assert_eq!(dup.status, EEXIST, "{dup:?}");
    let one = gw
        .list_namespaces(pb::ListNamespacesReq {
            subsystem: NQN.into(),
            nsid: Some(1),
            uuid: None,
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(one.status, 0);
    let ns = &one.namespaces[0];
    assert_eq!(
        (
            ns.rbd_pool_name.as_str(),
            ns.rbd_image_name.as_str(),
            ns.block_size
        ),
        ("rbd", "img1", 4096)
    );
    // The UUID is the one the gateways put in the namespace's identification descriptor:
    // the one gw1's assignment carries.
    let assignment = f.cp.assignment("gw1").expect("gw1 assignment");
    let pushed = assignment
        .namespaces
        .iter()
        .find(|n| n.subsystem_nqn == NQN && n.nsid == 1)
        .expect("pushed namespace");
    assert_eq!(ns.uuid, pushed.uuid);
    assert_eq!(ns.uuid.len(), 36);
    // 512-byte blocks too, listed by UUID.
    let second = gw
        .namespace_add(namespace_req("img2", 512))
        .await
        .expect("add")
        .into_inner();
    assert_eq!((second.status, second.nsid), (0, 2));
    let by_uuid = gw
        .list_namespaces(pb::ListNamespacesReq {
            subsystem: NQN.into(),
            nsid: None,
            uuid: Some(ns.uuid.to_uppercase()),
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(by_uuid.namespaces.len(), 1);
    assert_eq!(by_uuid.namespaces[0].nsid, 1);

    // ControllerPublish: the node's host NQN with its DH-HMAC-CHAP keys; EEXIST again.
    let host = pb::AddHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: NODE.into(),
        dhchap_key: Some(key(1)),
        dhchap_ctrlr_key: Some(key(2)),
        ..Default::default()
    };
    assert_eq!(
        gw.add_host(host.clone())
            .await
            .expect("add")
            .get_ref()
            .status,
        0
    );
    assert_eq!(
        gw.add_host(host.clone())
            .await
            .expect("again")
            .get_ref()
            .status,
        EEXIST
    );
    let stored = f.cp.state().hosts[&(NQN.to_string(), NODE.to_string())].clone();
    assert_eq!(stored.mode(), "bidirectional");
    let hosts = gw
        .list_hosts(pb::ListHostsReq {
            subsystem: NQN.into(),
            clear_alerts: None,
        })
        .await
        .expect("hosts")
        .into_inner();
    assert_eq!(hosts.hosts.len(), 1);
    assert_eq!(
        (hosts.hosts[0].nqn.as_str(), hosts.hosts[0].use_dhchap),
        (NODE, Some(true))
    );
    assert_eq!(
        hosts.hosts[0].dhchap_controller_origin,
        Some(pb::DhchapControllerKeyOrigin::HostSpecific as i32)
    );

    // The node connects (its connection reaches the control plane in gw1's beacon).
    beacon(&mut f.control, &[NODE]).await;
    let conns = gw
        .list_connections(pb::ListConnectionsReq {
            subsystem: NQN.into(),
            clear_alerts: None,
        })
        .await
        .expect("connections")
        .into_inner();
    assert_eq!(conns.connections.len(), 1);
    let c = &conns.connections[0];
    assert_eq!(
        (
            c.nqn.as_str(),
            c.connected,
            c.traddr.as_str(),
            c.trsvcid,
            c.qpairs_count
        ),
        (NODE, true, "127.0.0.1", 4420, 3)
    );

    // ControllerExpand: to 2 GiB (MiB in the request); the same size again changes nothing;
    // a shrink is refused.
    let resize = |mib: u64| pb::NamespaceResizeReq {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        new_size: mib,
        ..Default::default()
    };
    assert_eq!(
        gw.namespace_resize(resize(2048))
            .await
            .expect("grow")
            .get_ref()
            .status,
        0
    );
    assert_eq!(
        f.backend.sizes.lock().expect("sizes").get("rbd/img1"),
        Some(&(2 * GIB))
    );
    assert_eq!(
        gw.namespace_resize(resize(2048))
            .await
            .expect("same")
            .get_ref()
            .status,
        0
    );
    let shrink = gw
        .namespace_resize(resize(1024))
        .await
        .expect("shrink")
        .into_inner();
    assert_eq!(shrink.status, EINVAL, "{shrink:?}");

    // ControllerUnpublish: the node disconnected (NodeUnstage runs first), then remove_host;
    // a second remove_host answers ENOENT.
    beacon(&mut f.control, &[]).await;
    let remove = pb::RemoveHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: NODE.into(),
        ..Default::default()
    };
    assert_eq!(
        gw.remove_host(remove.clone())
            .await
            .expect("rm")
            .get_ref()
            .status,
        0
    );
    assert_eq!(
        gw.remove_host(remove)
            .await
            .expect("again")
            .get_ref()
            .status,
        ENOENT
    );
    assert!(f.cp.state().hosts.is_empty());

    // DeleteVolume: namespace_delete (ENODEV once gone), then the listeners and the subsystem
    // (ENOENT once gone); a namespace of a deleted subsystem: ENOENT.
    let del = |nsid| pb::NamespaceDeleteReq {
        subsystem_nqn: NQN.into(),
        nsid,
        ..Default::default()
    };
    for nsid in [1, 2] {
        assert_eq!(
            gw.namespace_delete(del(nsid))
                .await
                .expect("del")
                .get_ref()
                .status,
            0
        );
    }
    assert_eq!(
        gw.namespace_delete(del(1))
            .await
            .expect("again")
            .get_ref()
            .status,
        ENODEV
    );
    for host_name in ["gw1", "gw9"] {
        let l = listener_req(host_name);
        let req = pb::DeleteListenerReq {
            nqn: l.nqn,
            host_name: l.host_name,
            traddr: l.traddr,
            adrfam: l.adrfam,
            trsvcid: l.trsvcid,
            force: Some(true),
        };
        assert_eq!(
            gw.delete_listener(req.clone())
                .await
                .expect("del")
                .get_ref()
                .status,
            0
        );
        assert_eq!(
            gw.delete_listener(req)
                .await
                .expect("again")
                .get_ref()
                .status,
            ENOENT
        );
    }
    let del_sub = pb::DeleteSubsystemReq {
        subsystem_nqn: NQN.into(),
        ..Default::default()
    };
    assert_eq!(
        gw.delete_subsystem(del_sub.clone())
            .await
            .expect("del")
            .get_ref()
            .status,
        0
    );
    assert_eq!(
        gw.delete_subsystem(del_sub)
            .await
            .expect("again")
            .get_ref()
            .status,
        ENOENT
    );
    assert_eq!(
        gw.namespace_delete(del(1))
            .await
            .expect("gone")
            .get_ref()
            .status,
        ENOENT
    );
    let st = f.cp.state();
    assert!(st.subsystems.is_empty() && st.namespaces.is_empty() && st.listeners.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_its_errno_and_changes_nothing() {
    let mut f = start().await;
    let gw = &mut f.gw;
    assert_eq!(
        gw.create_subsystem(subsystem_req(NQN))
            .await
            .expect("create")
            .get_ref()
            .status,
        0
    );
    assert_eq!(
        gw.namespace_add(namespace_req("img1", 512))
            .await
            .expect("ns")
            .get_ref()
            .status,
        0
    );
    let before = config(&f.cp);
    let version = f.cp.state().version;

    let mut refusals: Vec<(&str, i32, String, i32, &str)> = Vec::new();
    let mut check =
        |what: &'static str, status: i32, message: String, want: i32, says: &'static str| {
            refusals.push((what, status, message, want, says));
        };

    let r = gw
        .create_subsystem(subsystem_req("not an nqn"))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "bad subsystem NQN",
        r.status,
        r.error_message,
        EINVAL,
        "invalid subsystem NQN",
    );
    let r = gw
        .create_subsystem(subsystem_req(NQN))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "existing subsystem",
        r.status,
        r.error_message,
        EEXIST,
        "already exists",
    );
    let mut unknown = namespace_req("img2", 512);
    unknown.subsystem_nqn = "nqn.2016-06.io.test:unknown".into();
    let r = gw.namespace_add(unknown).await.expect("rpc").into_inner();
    check(
        "unknown subsystem",
        r.status,
        r.error_message,
        ENOENT,
        "not found",
    );
    let mut dup = namespace_req("img2", 512);
    dup.nsid = Some(1);
    let r = gw.namespace_add(dup).await.expect("rpc").into_inner();
    check(
        "duplicate NSID",
        r.status,
        r.error_message,
        EEXIST,
        "namespace 1 already exists",
    );
    let r = gw
        .namespace_add(namespace_req("img1", 512))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "image already a namespace",
        r.status,
        r.error_message,
        EEXIST,
        "already namespace 1",
    );
    let r = gw
        .namespace_add(namespace_req("img2", 1024))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "block size",
        r.status,
        r.error_message,
        EINVAL,
        "block size 1024",
    );
    let r = gw
        .namespace_add(namespace_req("no-such", 512))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "missing image",
        r.status,
        r.error_message,
        ENOENT,
        "image rbd/no-such not found",
    );
    // A UUID another namespace has (img1's, named in another case), and one that is none.
    let taken =
        f.cp.snapshot()
            .namespaces
            .values()
            .next()
            .map(|n| n.uuid.to_uppercase())
            .expect("img1");
    let mut uuid = namespace_req("img2", 512);
    uuid.uuid = Some(taken);
    let r = gw.namespace_add(uuid).await.expect("rpc").into_inner();
    check(
        "UUID in use",
        r.status,
        r.error_message,
        EEXIST,
        "is already the identity of namespace 1",
    );
    let mut uuid = namespace_req("img2", 512);
    uuid.uuid = Some("8d6f1c5e-0000-4000-8000".into());
    let r = gw.namespace_add(uuid).await.expect("rpc").into_inner();
    check(
        "not a UUID",
        r.status,
        r.error_message,
        EINVAL,
        "invalid namespace UUID",
    );

    let host = |host_nqn: &str, k: &str, c: &str| pb::AddHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: host_nqn.into(),
        dhchap_key: Some(k.into()),
        dhchap_ctrlr_key: Some(c.into()),
        ..Default::default()
    };
    let r = gw
        .add_host(host("nqn.bad host", "", ""))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "bad host NQN",
        r.status,
        r.error_message,
        EINVAL,
        "invalid host NQN",
    );
    let mut bad_key = key(3);
    bad_key.replace_range(14..15, if &bad_key[14..15] == "A" { "B" } else { "A" });
    let r = gw
        .add_host(host(NODE, &bad_key, ""))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "bad key",
        r.status,
        r.error_message,
        EINVAL,
        "invalid dhchap_key",
    );
    let r = gw
        .add_host(host(NODE, "", &key(4)))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "controller key alone",
        r.status,
        r.error_message,
        EINVAL,
        "invalid dhchap_ctrlr_key",
    );
    let mut bad_psk = host(NODE, "", "");
    bad_psk.psk = Some("NVMeTLSkey-1:01:AAAA:".into());
    let r = gw.add_host(bad_psk).await.expect("rpc").into_inner();
    check(
        "malformed PSK",
        r.status,
        r.error_message,
        EINVAL,
        "invalid psk",
    );
    let mut bad_crc = host(NODE, "", "");
    let mut text = psk(6);
    text.replace_range(20..21, if &text[20..21] == "A" { "B" } else { "A" });
    bad_crc.psk = Some(text);
    let r = gw.add_host(bad_crc).await.expect("rpc").into_inner();
    check(
        "PSK with a bad CRC",
        r.status,
        r.error_message,
        EINVAL,
        "invalid psk",
    );
    let mut encrypted = host(NODE, "", "");
    encrypted.psk = Some(psk(7));
    encrypted.psk_encrypted = Some(true);
    let r = gw.add_host(encrypted).await.expect("rpc").into_inner();
    check(
        "encrypted PSK",
        r.status,
        r.error_message,
        EOPNOTSUPP,
        "encrypted keys",
    );
    let mut any_psk = host("*", "", "");
    any_psk.psk = Some(psk(8));
    let r = gw.add_host(any_psk).await.expect("rpc").into_inner();
    check(
        "PSK for any host",
        r.status,
        r.error_message,
        EINVAL,
        "any host",
    );
    let r = gw
        .add_host(host("*", &key(5), ""))
        .await
        .expect("rpc")
        .into_inner();
    check(
        "keys for any host",
        r.status,
        r.error_message,
        EINVAL,
        "any host",
    );
    let r = gw
        .remove_host(pb::RemoveHostReq {
            subsystem_nqn: NQN.into(),
            host_nqn: NODE.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    check(
        "host not allowed",
        r.status,
        r.error_message,
        ENOENT,
        "not allowed",
    );

    let mut ipv6 = listener_req("gw1");
    ipv6.adrfam = Some(pb::AddressFamily::Ipv6 as i32);
    let r = gw.create_listener(ipv6).await.expect("rpc").into_inner();
    check(
        "address of the other family",
        r.status,
        r.error_message,
        EINVAL,
        "not of family ipv6",
    );
    let mut unknown_secure = listener_req("gw1");
    unknown_secure.nqn = "nqn.2016-06.io.test:unknown".into();
    unknown_secure.secure = Some(true);
    let r = gw
        .create_listener(unknown_secure)
        .await
        .expect("rpc")
        .into_inner();
    check(
        "secure listener of an unknown subsystem",
        r.status,
        r.error_message,
        ENOENT,
        "not found",
    );
    let mut masked = subsystem_req("nqn.2016-06.io.test:masked");
    masked.network_mask = vec!["10.0.0.0/24".into()];
    let r = gw.create_subsystem(masked).await.expect("rpc").into_inner();
    check(
        "network_mask",
        r.status,
        r.error_message,
        EOPNOTSUPP,
        "network_mask",
    );
    let r = gw
        .delete_subsystem(pb::DeleteSubsystemReq {
            subsystem_nqn: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    check(
        "subsystem with namespaces",
        r.status,
        r.error_message,
        EBUSY,
        "still has 1 namespace",
    );

    // Keys never show in a refusal.
    let secret_part = &bad_key[10..50];
    let psk_parts = [psk(6)[16..40].to_string(), psk(7)[16..40].to_string()];
    for (what, status, message, want, says) in &refusals {
        for part in &psk_parts {
            assert!(
                !message.contains(part.as_str()),
                "{what}: the message shows a PSK"
            );
        }
        assert_eq!(status, want, "{what}: {message}");
        assert!(
            message.contains(says),
            "{what}: {message:?} does not say {says:?}"
        );
        assert!(
            !message.contains(secret_part),
            "{what}: the message shows a key"
        );
    }
    assert_eq!(config(&f.cp), before, "a refused request changed the state");
    assert_eq!(
        f.cp.state().version,
        version,
        "a refused request wrote the state"
    );
}

/// QoS limits, per-host visibility and image creation through the API (and their refusals,
/// state unchanged), I/O stats answered EOPNOTSUPP (after the namespace is found), a host
/// with connections is removed with EBUSY (as ceph-nvmeof answers; ceph-csi takes it as
/// done), `*` opens the subsystem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos_visibility_images_busy_hosts_and_any_host() {
    let mut f = start().await;
    let gw = &mut f.gw;
    assert_eq!(
        gw.create_subsystem(subsystem_req(NQN))
            .await
            .expect("create")
            .get_ref()
            .status,
        0
    );
    assert_eq!(
        gw.namespace_add(namespace_req("img1", 512))
            .await
            .expect("ns")
            .get_ref()
            .status,
        0
    );
    let before = config(&f.cp);

    // QoS: set (read back by list_namespaces), cleared by 0; a bad limit EINVAL, a missing
    // namespace ENODEV, both leaving the state.
    let qos = |nsid, iops| pb::NamespaceSetQosReq {
        subsystem_nqn: NQN.into(),
        nsid,
        rw_ios_per_second: Some(iops),
        w_mbytes_per_second: Some(50),
        ..Default::default()
    };
    let r = gw
        .namespace_set_qos_limits(qos(1, 1000))
        .await
        .expect("qos")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let listed = |gw: &mut GatewayClient<Channel>| {
        let mut gw = gw.clone();
        async move {
            gw.list_namespaces(pb::ListNamespacesReq {
                subsystem: NQN.into(),
                nsid: Some(1),
                uuid: None,
            })
            .await
            .expect("list")
            .into_inner()
            .namespaces
            .remove(0)
        }
    };
    let ns = listed(gw).await;
    assert_eq!((ns.rw_ios_per_second, ns.w_mbytes_per_second), (1000, 50));
    let limited = config(&f.cp);
    for (what, req, want) in [
        ("absurd IOPS", qos(1, 1 << 40), EINVAL),
        ("IOPS below the minimum", qos(1, 3), EINVAL),
        ("missing namespace", qos(7, 1000), ENODEV),
    ] {
        let r = gw
            .namespace_set_qos_limits(req)
            .await
            .expect("qos")
            .into_inner();
        assert_eq!(r.status, want, "{what}: {r:?}");
        assert_eq!(config(&f.cp), limited, "{what} changed the state");
    }
    let r = gw
        .namespace_set_qos_limits(pb::NamespaceSetQosReq {
            subsystem_nqn: NQN.into(),
            nsid: 1,
            rw_ios_per_second: Some(0),
            w_mbytes_per_second: Some(0),
            ..Default::default()
        })
        .await
        .expect("qos")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(
        f.cp.state().namespaces,
        before.namespaces,
        "limits cleared: the namespaces as before"
    );

    // Per-host visibility: a namespace added no_auto_visible is listed with no host, gains
    // and loses one; twice answers EEXIST / ENOENT; on an auto-visible one EINVAL.
    let mut hidden = namespace_req("img2", 512);
    hidden.no_auto_visible = Some(true);
    let added = gw.namespace_add(hidden).await.expect("rpc").into_inner();
    assert_eq!((added.status, added.nsid), (0, 2), "{added:?}");
    let ns_host = |nsid| pb::NamespaceAddHostReq {
        subsystem_nqn: NQN.into(),
        nsid,
        host_nqn: NODE.into(),
        force: None,
    };
    let ns_del_host = |nsid| pb::NamespaceDeleteHostReq {
        subsystem_nqn: NQN.into(),
        nsid,
        host_nqn: NODE.into(),
    };
    for (what, nsid, want) in [
        ("add host", 2, 0),
        ("add host again", 2, EEXIST),
        ("add host to an auto-visible namespace", 1, EINVAL),
    ] {
        let r = gw
            .namespace_add_host(ns_host(nsid))
            .await
            .expect("rpc")
            .into_inner();
        assert_eq!(r.status, want, "{what}: {r:?}");
    }
    let entry = &f.cp.state().namespaces[&(NQN.to_string(), 2)];
    assert!(entry.no_auto_visible);
    assert_eq!(entry.hosts.iter().collect::<Vec<_>>(), vec![NODE]);
    for (what, want) in [("delete host", 0), ("delete host again", ENOENT)] {
        let r = gw
            .namespace_delete_host(ns_del_host(2))
            .await
            .expect("rpc")
            .into_inner();
        assert_eq!(r.status, want, "{what}: {r:?}");
    }
    assert!(f.cp.state().namespaces[&(NQN.to_string(), 2)]
        .hosts
        .is_empty());

    // create_image: the image made, then the namespace; again EEXIST; no size EINVAL.
    let mut create = namespace_req("new-image", 512);
    create.create_image = Some(true);
    create.size = Some(GIB);
    let r = gw
        .namespace_add(create.clone())
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!((r.status, r.nsid), (0, 3), "{r:?}");
    let made = config(&f.cp);
    create.nsid = Some(9);
    let r = gw
        .namespace_add(create.clone())
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EEXIST, "image exists: {r:?}");
    create.rbd_image_name = "other-image".into();
    create.size = None;
    let r = gw.namespace_add(create).await.expect("rpc").into_inner();
    assert_eq!(r.status, EINVAL, "no size: {r:?}");
    assert_eq!(config(&f.cp), made, "refusals changed the state");
    let stats = gw
        .namespace_get_io_stats(pb::NamespaceGetIoStatsReq {
            subsystem_nqn: NQN.into(),
            nsid: 1,
            ..Default::default()
        })
        .await
        .expect("stats")
        .into_inner();
    // No gateway reported I/O for it: zeros, not a refusal.
    assert_eq!(
        (stats.status, stats.num_read_ops, stats.tick_rate),
        (0, 0, 1_000_000_000),
        "{stats:?}"
    );

    // A host still connected: removed (the gateways close its controllers), EBUSY says it
    // was; with keep_connections it is refused and stays.
    let add = |host: &str| pb::AddHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: host.into(),
        ..Default::default()
    };
    assert_eq!(
        gw.add_host(add(NODE)).await.expect("add").get_ref().status,
        0
    );
    beacon(&mut f.control, &[NODE]).await;
    let keep = pb::RemoveHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: NODE.into(),
        keep_connections: Some(true),
        ..Default::default()
    };
    assert_eq!(
        gw.remove_host(keep).await.expect("rm").get_ref().status,
        EOPNOTSUPP
    );
    assert_eq!(f.cp.state().hosts_of(NQN), vec![NODE.to_string()]);
    let busy = gw
        .remove_host(pb::RemoveHostReq {
            subsystem_nqn: NQN.into(),
            host_nqn: NODE.into(),
            ..Default::default()
        })
        .await
        .expect("rm")
        .into_inner();
    assert_eq!(busy.status, EBUSY, "{busy:?}");
    assert!(busy.error_message.contains("removed"), "{busy:?}");
    assert!(f.cp.state().hosts_of(NQN).is_empty());
    // With force, a connected host's removal answers 0.
    assert_eq!(
        gw.add_host(add(NODE)).await.expect("add").get_ref().status,
        0
    );
    let forced = pb::RemoveHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: NODE.into(),
        force: Some(true),
        ..Default::default()
    };
    assert_eq!(
        gw.remove_host(forced).await.expect("rm").get_ref().status,
        0
    );

    // `*`: any host, and back; twice answers EEXIST / ENOENT.
    assert_eq!(
        gw.add_host(add("*")).await.expect("any").get_ref().status,
        0
    );
    assert!(f.cp.state().subsystems[NQN].allow_any_host);
    assert_eq!(
        gw.add_host(add("*")).await.expect("any").get_ref().status,
        EEXIST
    );
    let hosts = gw
        .list_hosts(pb::ListHostsReq {
            subsystem: NQN.into(),
            clear_alerts: None,
        })
        .await
        .expect("hosts")
        .into_inner();
    assert!(hosts.allow_any_host);
    let closed = pb::RemoveHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: "*".into(),
        ..Default::default()
    };
    assert_eq!(
        gw.remove_host(closed.clone())
            .await
            .expect("close")
            .get_ref()
            .status,
        0
    );
    assert!(!f.cp.state().subsystems[NQN].allow_any_host);
    assert_eq!(
        gw.remove_host(closed)
            .await
            .expect("close")
            .get_ref()
            .status,
        ENOENT
    );

    let info = gw
        .get_gateway_info(pb::GetGatewayInfoReq {
            cli_version: Some("1.5.0".into()),
        })
        .await
        .expect("info")
        .into_inner();
    assert_eq!((info.status, info.bool_status), (0, true));
    assert_eq!(info.name, "csi-test");
    assert_eq!(info.cli_version, "1.5.0");
    assert_eq!(info.gateway_initialization_over, Some(true));
    assert_eq!(
        info.max_namespaces_per_subsystem,
        Some(state::DEFAULT_MAX_NAMESPACES)
    );
}

/// The method paths are `/Gateway/<name>` (no proto package), checked with a raw call that
/// does not go through the generated client.
/// NVMe/TCP TLS through the API, into the same group state `nvmeofctl` makes: a secure
/// listener, a host with a PSK (stored in canonical text with the default derivation, listed
/// as `use_psk` and never shown), `secure_listeners` on create_subsystem accepted without
/// requiring TLS (ceph-nvmeof applies it to network_mask's listeners only), connections over
/// TLS listed as such; refusals (a listener disagreeing with the port's TLS setting, a
/// duplicate host, an unknown subsystem) answer their errno and change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_options_map_to_the_group_state() {
    let mut f = start().await;
    let gw = &mut f.gw;
    const OTHER: &str = "nqn.2016-06.io.test:other";
    const PLAIN_HOST: &str = "nqn.2014-08.org.nvmexpress:node-2";

    let mut create = subsystem_req(NQN);
    create.secure_listeners = Some(true);
    let r = gw.create_subsystem(create).await.expect("rpc").into_inner();
    assert_eq!((r.status, r.error_message.as_str()), (0, ""));
    assert!(
        !f.cp.state().subsystems[NQN].require_tls,
        "secure_listeners made the subsystem require TLS"
    );
    assert_eq!(
        gw.create_subsystem(subsystem_req(OTHER))
            .await
            .expect("rpc")
            .get_ref()
            .status,
        0
    );

    let mut secure = listener_req("gw1");
    secure.secure = Some(true);
    let r = gw.create_listener(secure).await.expect("rpc").into_inner();
    assert_eq!((r.status, r.error_message.as_str()), (0, ""));
    let mut plain = listener_req("gw1");
    plain.trsvcid = Some(4421);
    assert_eq!(
        gw.create_listener(plain)
            .await
            .expect("rpc")
            .get_ref()
            .status,
        0
    );
    let stored: Vec<(u16, bool)> =
        f.cp.state()
            .listeners
            .iter()
            .map(|l| (l.port, l.secure))
            .collect();
    assert_eq!(stored, [(4420, true), (4421, false)]);
    let listed = gw
        .list_listeners(pb::ListListenersReq {
            subsystem: NQN.into(),
        })
        .await
        .expect("list")
        .into_inner();
    let listed: Vec<(u32, Option<bool>)> = listed
        .listeners
        .iter()
        .map(|l| (l.trsvcid, l.secure))
        .collect();
    assert_eq!(listed, [(4420, Some(true)), (4421, Some(false))]);

    let key = psk(9);
    let add = |host_nqn: &str, nqn: &str, k: Option<String>| pb::AddHostReq {
        subsystem_nqn: nqn.into(),
        host_nqn: host_nqn.into(),
        // Surrounding blanks, as read from a file, are not part of the key.
        psk: k.map(|k| format!(" {k}\n")),
        ..Default::default()
    };
    let r = gw
        .add_host(add(NODE, NQN, Some(key.clone())))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!((r.status, r.error_message.as_str()), (0, ""));
    assert_eq!(
        gw.add_host(add(PLAIN_HOST, NQN, None))
            .await
            .expect("rpc")
            .get_ref()
            .status,
        0
    );
    let st = f.cp.state();
    let auth = &st.hosts[&(NQN.to_string(), NODE.to_string())];
    assert_eq!(auth.psk.as_deref(), Some(key.as_str()));
    assert_eq!(
        auth.psk_derivation, None,
        "the default derivation (rfc8446)"
    );
    assert_eq!(auth.mode(), "none", "no DH-HMAC-CHAP key came with the PSK");
    let hosts = gw
        .list_hosts(pb::ListHostsReq {
            subsystem: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("hosts")
        .into_inner();
    let use_psk: Vec<(&str, Option<bool>)> = hosts
        .hosts
        .iter()
        .map(|h| (h.nqn.as_str(), h.use_psk))
        .collect();
    assert_eq!(use_psk, [(NODE, Some(true)), (PLAIN_HOST, Some(false))]);
    assert!(
        !format!("{hosts:?}").contains(&key[16..40]),
        "a listing shows the PSK"
    );

    // Refusals: errno, and the state as it was.
    let before = config(&f.cp);
    let mut disagreeing = listener_req("gw1");
    disagreeing.nqn = OTHER.into();
    let r = gw
        .create_listener(disagreeing)
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EINVAL, "{}", r.error_message);
    assert!(
        r.error_message.contains("already secure"),
        "{}",
        r.error_message
    );
    let mut existing = listener_req("gw1");
    existing.secure = Some(true);
    let r = gw
        .create_listener(existing)
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EEXIST, "{}", r.error_message);
    let r = gw
        .add_host(add(NODE, NQN, Some(psk(10))))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EEXIST, "{}", r.error_message);
    let r = gw
        .add_host(add(NODE, "nqn.2016-06.io.test:unknown", Some(psk(10))))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, ENOENT, "{}", r.error_message);
    assert_eq!(config(&f.cp), before, "a refused request changed the state");

    // Connections: as the gateways report them, over TLS or not.
    beacon_tls(&mut f.control, &[(NODE, true), (PLAIN_HOST, false)]).await;
    let conns =
        f.gw.list_connections(pb::ListConnectionsReq {
            subsystem: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("connections")
        .into_inner();
    let seen: Vec<(&str, bool, Option<bool>, Option<bool>)> = conns
        .connections
        .iter()
        .map(|c| (c.nqn.as_str(), c.connected, c.secure, c.use_psk))
        .collect();
    assert_eq!(
        seen,
        [
            (NODE, true, Some(true), Some(true)),
            (PLAIN_HOST, true, Some(false), Some(false)),
        ]
    );
    beacon(&mut f.control, &[]).await;
    let conns =
        f.gw.list_connections(pb::ListConnectionsReq {
            subsystem: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("connections")
        .into_inner();
    let seen: Vec<(&str, bool, Option<bool>)> = conns
        .connections
        .iter()
        .map(|c| (c.nqn.as_str(), c.connected, c.use_psk))
        .collect();
    assert_eq!(
        seen,
        [(NODE, false, Some(true)), (PLAIN_HOST, false, Some(false))],
        "a host not connected: use_psk says whether it has a PSK"
    );

    // A secure listener is deleted without naming its flag (as ceph-csi's delete carries none).
    assert_eq!(
        f.gw.delete_listener(pb::DeleteListenerReq {
            nqn: NQN.into(),
            host_name: "gw1".into(),
            traddr: "127.0.0.1".into(),
            trsvcid: Some(4420),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .get_ref()
        .status,
        0
    );
    assert_eq!(f.cp.state().listeners.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_are_served_at_package_less_paths() {
    let f = start().await;
    drop(f.gw);
    let addr = test_support::serve_plain(f.cp.clone()).await;
    let mut grpc = tonic::client::Grpc::new(plain_channel(&addr).await);
    grpc.ready().await.expect("ready");
    let reply: tonic::Response<pb::SubsystemsInfoCli> = grpc
        .unary(
            tonic::Request::new(pb::ListSubsystemsReq::default()),
            tonic::codegen::http::uri::PathAndQuery::from_static("/Gateway/list_subsystems"),
            tonic::codec::ProstCodec::default(),
        )
        .await
        .expect("/Gateway/list_subsystems answered");
    assert_eq!(reply.get_ref().status, 0);
    // A method of the API this gateway does not serve: UNIMPLEMENTED.
    grpc.ready().await.expect("ready");
    let missing: Result<tonic::Response<pb::ReqStatus>, _> = grpc
        .unary(
            tonic::Request::new(pb::ListSubsystemsReq::default()),
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/Gateway/add_kmip_server_endpoints",
            ),
            tonic::codec::ProstCodec::default(),
        )
        .await;
    assert_eq!(
        missing.expect_err("unserved").code(),
        tonic::Code::Unimplemented
    );
}

/// With mTLS on, the API is behind it like the Admin API.
#[tokio::test]
async fn the_api_is_behind_the_same_mtls() {
    let pki = TestPki::create("cp-tls-ceph-api");
    let addr = serve_in_memory_over_tls(&pki.server, "tls-ceph-api").await;
    let list = |files: tls::TlsFiles| {
        let addr = addr.clone();
        async move {
            let config = tls::client_tls_config(&files, None).map_err(|e| e.to_string())?;
            let channel = tls::client_endpoint(&addr, config.as_ref())
                .map_err(|e| e.to_string())?
                .connect_timeout(Duration::from_secs(3))
                .timeout(Duration::from_secs(5))
                .connect()
                .await
                .map_err(|e| tls::chain(&e))?;
            GatewayClient::new(channel)
                .list_subsystems(pb::ListSubsystemsReq::default())
                .await
                .map(|r| r.into_inner().status)
                .map_err(|s| tls::chain(&s))
        }
    };
    assert_eq!(list(pki.client.clone()).await, Ok(0));
    let without_certificate = tls::TlsFiles {
        ca: Some(pki.ca.clone()),
        cert: None,
        key: None,
    };
    assert!(list(without_certificate).await.is_err());
    assert!(list(pki.stranger.clone()).await.is_err());
    assert!(
        list(tls::TlsFiles::default()).await.is_err(),
        "plain text served"
    );
}

const ENOKEY: i32 = 126;

/// A beacon of another gateway, owning ANA group `group`.
async fn beacon_gateway(c: &mut GatewayControlClient<Channel>, name: &str, group: u32) {
    c.send_beacon(proto::Beacon {
        gateway: name.into(),
        ana_group: group,
        incarnation: 1,
        client_addrs: vec![format!("127.0.0.1:0/{group}")],
        ..Default::default()
    })
    .await
    .expect("beacon");
}

/// The calls ceph-nvmeof's CLI and the Ceph dashboard make beyond ceph-csi's: the gateway's
/// version (an X.Y.Z the CLI accepts, ours in the message), log levels (group-wide, pushed
/// to gateways in their assignment), listener status per gateway, the subsystem's
/// DH-HMAC-CHAP key (the controller key its hosts get), load-balancing group = ANA group,
/// visibility, trash-on-delete, auto-resize, get_subsystems, the images' real sizes, the
/// SPDK calls refused; every bad input answers its errno and leaves the state as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_and_dashboard_calls() {
    let mut f = start().await;
    beacon_gateway(&mut f.control, "gw2", 2).await;
    let gw = &mut f.gw;
    f.backend
        .sizes
        .lock()
        .expect("sizes")
        .insert("rbd/img1".into(), 3 * GIB);
    assert_eq!(
        gw.create_subsystem(subsystem_req(NQN))
            .await
            .expect("rpc")
            .get_ref()
            .status,
        0
    );
    assert_eq!(
        gw.create_listener(listener_req("gw1"))
            .await
            .expect("rpc")
            .get_ref()
            .status,
        0
    );
    let mut ns = namespace_req("img1", 512);
    ns.anagrpid = Some(1);
    assert_eq!(gw.namespace_add(ns).await.expect("rpc").get_ref().status, 0);

    // Version: X.Y.Z >= 1.1.0 (what the CLI checks), ours in the message.
    let info = gw
        .get_gateway_info(pb::GetGatewayInfoReq {
            cli_version: Some("1.5.4".into()),
        })
        .await
        .expect("info")
        .into_inner();
    let parts: Vec<u32> = info
        .version
        .split('.')
        .map(|p| p.parse().expect("numeric"))
        .collect();
    assert_eq!(parts.len(), 3, "{}", info.version);
    assert!(parts >= vec![1, 1, 0], "{}", info.version);
    assert_eq!(info.version, control_plane::ceph_api::CEPH_NVMEOF_API_LEVEL);
    assert!(
        info.error_message
            .contains(&format!("ceph-nvmeof-rs {}", env!("CARGO_PKG_VERSION"))),
        "{}",
        info.error_message
    );

    // rbd_image_size: the image's size in RBD, and after a resize the new one.
    let listed = |gw: &mut GatewayClient<Channel>| {
        let mut gw = gw.clone();
        async move {
            gw.list_namespaces(pb::ListNamespacesReq {
                subsystem: NQN.into(),
                nsid: Some(1),
                uuid: None,
            })
            .await
            .expect("list")
            .into_inner()
            .namespaces
            .remove(0)
        }
    };
    assert_eq!(listed(gw).await.rbd_image_size, 3 * GIB);
    let grown = gw
        .namespace_resize(pb::NamespaceResizeReq {
            subsystem_nqn: NQN.into(),
            nsid: 1,
            new_size: 4096,
            ..Default::default()
        })
        .await
        .expect("resize")
        .into_inner();
    assert_eq!(grown.status, 0, "{grown:?}");
    assert_eq!(listed(gw).await.rbd_image_size, 4 * GIB);

    // Load-balancing group = ANA group, as `nvmeofctl namespace move`.
    let lb = |nsid: u32, anagrpid: i32| pb::NamespaceChangeLoadBalancingGroupReq {
        subsystem_nqn: NQN.into(),
        nsid,
        anagrpid,
        ..Default::default()
    };
    let moved = gw
        .namespace_change_load_balancing_group(lb(1, 2))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(moved.status, 0, "{moved:?}");
    let entry = f.cp.state().namespaces[&(NQN.to_string(), 1)].clone();
    assert_eq!((entry.ana_group, entry.moving_from), (2, 0));
    assert_eq!(listed(gw).await.load_balancing_group, 2);
    let before = config(&f.cp);
    for (req, errno, text) in [
        (lb(1, 7), ENODEV, "ANA group 7 has no gateway"),
        (lb(9, 1), ENODEV, "namespace 9 not found"),
        (lb(1, -1), EINVAL, "negative"),
    ] {
        let r = gw
            .namespace_change_load_balancing_group(req)
            .await
            .expect("rpc")
            .into_inner();
        assert_eq!(r.status, errno, "{r:?}");
        assert!(r.error_message.contains(text), "{r:?}");
    }
    let mut unknown = lb(1, 1);
    unknown.subsystem_nqn = "nqn.2016-06.io.test:none".into();
    let r = gw
        .namespace_change_load_balancing_group(unknown)
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, ENOENT, "{r:?}");
    assert_eq!(config(&f.cp), before, "refusals changed the state");

    // Visibility: to the listed hosts only, a host added, back to all only with force.
    let vis = |nsid: u32, auto_visible: bool, force: bool| pb::NamespaceChangeVisibilityReq {
        subsystem_nqn: NQN.into(),
        nsid,
        auto_visible,
        force: Some(force),
    };
    let r = gw
        .namespace_change_visibility(vis(1, false, false))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert!(!listed(gw).await.auto_visible);
    let add = gw
        .namespace_add_host(pb::NamespaceAddHostReq {
            subsystem_nqn: NQN.into(),
            nsid: 1,
            host_nqn: NODE.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(add.status, 0, "{add:?}");
    let before = config(&f.cp);
    let r = gw
        .namespace_change_visibility(vis(1, true, false))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EBUSY, "{r:?}");
    assert!(r.error_message.contains("1 host(s) on its list"), "{r:?}");
    let r = gw
        .namespace_change_visibility(vis(5, true, true))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, ENODEV, "{r:?}");
    assert_eq!(config(&f.cp), before, "refusals changed the state");
    let r = gw
        .namespace_change_visibility(vis(1, true, true))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let n = listed(gw).await;
    assert!(n.auto_visible && n.hosts.is_empty(), "{n:?}");
    let pushed = f.cp.assignment("gw1").expect("assignment");
    assert!(!pushed.namespaces[0].no_auto_visible);

    // Auto-resize: on by default (the namespace follows its image). Off freezes the size
    // hosts see in the group state (pushed to every gateway); an `rbd resize` then changes
    // nothing, a namespace_resize changes the frozen size; on again follows the image.
    let ar = |nsid: u32, auto_resize: bool| pb::NamespaceSetAutoResizeReq {
        subsystem_nqn: NQN.into(),
        nsid,
        auto_resize,
    };
    let frozen = |cp: &ControlPlane| cp.state().namespaces[&(NQN.to_string(), 1)].frozen_size;
    let pushed_frozen =
        |cp: &ControlPlane| cp.assignment("gw1").expect("assignment").namespaces[0].frozen_size;
    let r = gw
        .namespace_set_auto_resize(ar(1, true))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, 0, "{:?}", r.get_ref());
    assert_eq!(frozen(&f.cp), None);
    assert_eq!(listed(gw).await.disable_auto_resize, Some(false));
    let r = gw
        .namespace_set_auto_resize(ar(1, false))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, 0, "{:?}", r.get_ref());
    assert_eq!(
        frozen(&f.cp),
        Some(4 * GIB),
        "the image's size when turned off"
    );
    assert_eq!(pushed_frozen(&f.cp), 4 * GIB);
    assert_eq!(listed(gw).await.disable_auto_resize, Some(true));
    // The image grows outside (rbd resize): off again keeps the size frozen first.
    f.backend
        .sizes
        .lock()
        .expect("sizes")
        .insert("rbd/img1".into(), 6 * GIB);
    let r = gw
        .namespace_set_auto_resize(ar(1, false))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, 0, "{:?}", r.get_ref());
    assert_eq!(frozen(&f.cp), Some(4 * GIB));
    let resize = |new_size: u64| pb::NamespaceResizeReq {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        new_size,
        ..Default::default()
    };
    // Below the (grown) image: only the frozen size moves, the image is left as it is.
    let r = gw
        .namespace_resize(resize(5120))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(frozen(&f.cp), Some(5 * GIB));
    assert_eq!(pushed_frozen(&f.cp), 5 * GIB);
    assert_eq!(listed(gw).await.rbd_image_size, 6 * GIB);
    // A shrink of the frozen size: refused, nothing changed.
    let r = gw
        .namespace_resize(resize(4096))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EINVAL, "{r:?}");
    assert_eq!(frozen(&f.cp), Some(5 * GIB));
    // Above the image: the image grows to it too.
    let r = gw
        .namespace_resize(resize(8192))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(frozen(&f.cp), Some(8 * GIB));
    assert_eq!(listed(gw).await.rbd_image_size, 8 * GIB);
    // Bad input: an unknown NSID or subsystem, the state unchanged.
    let before = f.cp.state();
    let r = gw
        .namespace_set_auto_resize(ar(4, false))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, ENODEV, "{:?}", r.get_ref());
    let r = gw
        .namespace_set_auto_resize(pb::NamespaceSetAutoResizeReq {
            subsystem_nqn: "nqn.2016-06.io.test:unknown".into(),
            nsid: 1,
            auto_resize: false,
        })
        .await
        .expect("rpc");
    assert_ne!(r.get_ref().status, 0, "{:?}", r.get_ref());
    assert_eq!(f.cp.state().namespaces, before.namespaces);
    // On again: the namespace follows its image.
    let r = gw
        .namespace_set_auto_resize(ar(1, true))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, 0, "{:?}", r.get_ref());
    assert_eq!(frozen(&f.cp), None);
    assert_eq!(pushed_frozen(&f.cp), 0);
    assert_eq!(listed(gw).await.disable_auto_resize, Some(false));

    // Trash on delete: the flag is kept with the namespace; a delete needs i_am_sure, and
    // then the image is in the trash, not deleted outright and not left in the pool.
    let trash = |nsid: u32, trash_image: bool| pb::NamespaceSetRbdTrashImageReq {
        subsystem_nqn: NQN.into(),
        nsid,
        trash_image,
    };
    let r = gw
        .namespace_set_rbd_trash_image(trash(3, true))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, ENODEV);
    let r = gw
        .namespace_set_rbd_trash_image(trash(1, true))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, 0);
    assert!(f.cp.state().namespaces[&(NQN.to_string(), 1)].trash_image);
    assert_eq!(listed(gw).await.trash_image, Some(true));
    let del = |i_am_sure: bool| pb::NamespaceDeleteReq {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        i_am_sure: Some(i_am_sure),
        ..Default::default()
    };
    let before = config(&f.cp);
    let r = gw
        .namespace_delete(del(false))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EINVAL, "{r:?}");
    assert!(r.error_message.contains("i_am_sure"), "{r:?}");
    assert_eq!(
        config(&f.cp),
        before,
        "an unconfirmed delete changed the state"
    );
    let r = gw
        .namespace_delete(del(true))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert!(f.cp.state().namespaces.is_empty());
    assert!(f
        .backend
        .trashed
        .lock()
        .expect("trashed")
        .contains("rbd/img1"));
    assert!(!f
        .backend
        .images
        .lock()
        .expect("images")
        .contains("rbd/img1"));
    // Added with create_image and trash_image: trashed with its namespace too.
    let mut created = namespace_req("made", 512);
    created.create_image = Some(true);
    created.size = Some(GIB);
    created.trash_image = Some(true);
    let r = gw.namespace_add(created).await.expect("rpc").into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert!(f.cp.state().namespaces[&(NQN.to_string(), r.nsid)].trash_image);
    // An existing image is not trashed unless asked for explicitly (as in ceph-nvmeof).
    let mut existing = namespace_req("img2", 512);
    existing.trash_image = Some(true);
    let r = gw.namespace_add(existing).await.expect("rpc").into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert!(!f.cp.state().namespaces[&(NQN.to_string(), r.nsid)].trash_image);

    // The subsystem's DH-HMAC-CHAP key: every host needs a key of its own first; it is the
    // controller key of hosts without one, pushed to the gateways.
    let key_req = |nqn: &str, k: &str| pb::ChangeSubsystemKeyReq {
        subsystem_nqn: nqn.into(),
        dhchap_key: Some(k.into()),
    };
    let keyed = pb::AddHostReq {
        subsystem_nqn: NQN.into(),
        host_nqn: NODE.into(),
        dhchap_key: Some(key(1)),
        ..Default::default()
    };
    assert_eq!(gw.add_host(keyed).await.expect("rpc").get_ref().status, 0);
    let plain = "nqn.2014-08.org.nvmexpress:node-plain";
    assert_eq!(
        gw.add_host(pb::AddHostReq {
            subsystem_nqn: NQN.into(),
            host_nqn: plain.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .get_ref()
        .status,
        0
    );
    let before = config(&f.cp);
    for (req, errno, text) in [
        (key_req(NQN, &key(9)), EINVAL, plain),
        (key_req(NQN, "DHHC-1:00:bad:"), EINVAL, "invalid dhchap_key"),
        (
            key_req("nqn.2016-06.io.test:none", &key(9)),
            ENOENT,
            "not found",
        ),
    ] {
        let r = gw
            .change_subsystem_key(req)
            .await
            .expect("rpc")
            .into_inner();
        assert_eq!(r.status, errno, "{r:?}");
        assert!(r.error_message.contains(text), "{r:?}");
        assert!(!r.error_message.contains("DHHC-1:00:bad"), "a key in {r:?}");
    }
    assert_eq!(config(&f.cp), before, "refusals changed the state");
    assert_eq!(
        gw.remove_host(pb::RemoveHostReq {
            subsystem_nqn: NQN.into(),
            host_nqn: plain.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .get_ref()
        .status,
        0
    );
    let r = gw
        .change_subsystem_key(key_req(NQN, &key(9)))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(
        f.cp.state().subsystems[NQN].dhchap_key.as_deref(),
        Some(key(9).as_str())
    );
    let pushed = f.cp.assignment("gw1").expect("assignment");
    let node = pushed.subsystems[0]
        .host_entries
        .iter()
        .find(|h| h.host_nqn == NODE)
        .expect("node pushed");
    assert_eq!(
        (node.dhchap_key.clone(), node.dhchap_ctrl_key.clone()),
        (key(1), key(9))
    );
    let hosts = gw
        .list_hosts(pb::ListHostsReq {
            subsystem: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(
        hosts.hosts[0].dhchap_controller_origin,
        Some(pb::DhchapControllerKeyOrigin::SubsystemImplicit as i32)
    );
    let subs = gw
        .list_subsystems(pb::ListSubsystemsReq::default())
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(subs.subsystems[0].has_dhchap_key, Some(true));
    let r = gw
        .change_subsystem_key(key_req(NQN, ""))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(f.cp.state().subsystems[NQN].dhchap_key, None);
    let pushed = f.cp.assignment("gw1").expect("assignment");
    assert_eq!(pushed.subsystems[0].host_entries[0].dhchap_ctrl_key, "");

    // create_subsystem with a key: created with it in one change; a bad key creates nothing.
    let mut keyed = subsystem_req("nqn.2016-06.io.test:keyed");
    keyed.dhchap_key = Some("DHHC-1:00:bad:".into());
    let before = config(&f.cp);
    let r = gw
        .create_subsystem(keyed.clone())
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EINVAL, "{r:?}");
    assert!(r.error_message.contains("invalid dhchap_key"), "{r:?}");
    assert_eq!(config(&f.cp), before, "a bad key created the subsystem");
    keyed.dhchap_key = Some(key(5));
    let r = gw.create_subsystem(keyed).await.expect("rpc").into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(
        f.cp.state().subsystems["nqn.2016-06.io.test:keyed"]
            .dhchap_key
            .as_deref(),
        Some(key(5).as_str())
    );
    assert_eq!(
        gw.delete_subsystem(pb::DeleteSubsystemReq {
            subsystem_nqn: "nqn.2016-06.io.test:keyed".into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .get_ref()
        .status,
        0
    );

    // get_subsystems: listeners, hosts and namespaces of every subsystem.
    let all = gw
        .get_subsystems(pb::GetSubsystemsReq {})
        .await
        .expect("rpc")
        .into_inner();
    let s = &all.subsystems[0];
    assert_eq!(s.nqn, NQN);
    assert_eq!(
        (
            s.listen_addresses[0].traddr.as_str(),
            s.listen_addresses[0].trsvcid.as_str()
        ),
        ("127.0.0.1", "4420")
    );
    assert_eq!(
        s.hosts.iter().map(|h| h.nqn.as_str()).collect::<Vec<_>>(),
        [NODE]
    );
    let nsids: Vec<u32> = s.namespaces.iter().map(|n| n.nsid).collect();
    let stored: Vec<u32> = f.cp.state().namespaces.keys().map(|(_, id)| *id).collect();
    assert_eq!(nsids, stored);
    assert_eq!(s.has_dhchap_key, Some(false));

    // Listener status: each listener with the ANA state of every group on its gateway.
    let li = gw
        .show_gateway_listeners_info(pb::ShowGatewayListenersInfoReq {
            subsystem_nqn: NQN.into(),
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(li.status, 0, "{li:?}");
    let l = &li.gw_listeners[0];
    assert_eq!(
        l.listener.as_ref().map(|l| l.host_name.as_str()),
        Some("gw1")
    );
    let states: Vec<(u32, i32)> = l.lb_states.iter().map(|s| (s.grp_id, s.state)).collect();
    let expected: Vec<(u32, i32)> =
        f.cp.state()
            .map
            .expect("map")
            .ana_states("gw1")
            .into_iter()
            .map(|(g, s)| (g, i32::from(s.code())))
            .collect();
    assert_eq!(states, expected);
    assert!(
        states.contains(&(1, pb::AnaState::Optimized as i32)),
        "gw1 holds its own group: {states:?}"
    );
    let r = gw
        .show_gateway_listeners_info(pb::ShowGatewayListenersInfoReq {
            subsystem_nqn: "nqn.2016-06.io.test:none".into(),
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, ENOENT, "{r:?}");

    // Log level: group-wide, in the state and pushed to gateways; bad levels refused.
    let set = |level: i32| pb::SetGatewayLogLevelReq { log_level: level };
    let r = gw
        .set_gateway_log_level(set(pb::GwLogLevel::Warning as i32))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(f.cp.state().settings.log_level.as_deref(), Some("warn"));
    assert_eq!(
        f.cp.assignment("gw2").expect("assignment").log_level,
        "warn"
    );
    let got = gw
        .get_gateway_log_level(pb::GetGatewayLogLevelReq {})
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(
        (got.status, got.log_level),
        (0, pb::GwLogLevel::Warning as i32)
    );
    let before = config(&f.cp);
    for (level, errno) in [(15, ENOKEY), (pb::GwLogLevel::Notset as i32, EINVAL)] {
        let r = gw.set_gateway_log_level(set(level)).await.expect("rpc");
        assert_eq!(r.get_ref().status, errno, "{:?}", r.get_ref());
    }
    assert_eq!(config(&f.cp), before, "refusals changed the state");
    let r = gw
        .set_gateway_log_level(set(pb::GwLogLevel::Critical as i32))
        .await
        .expect("rpc");
    assert_eq!(r.get_ref().status, 0);
    assert_eq!(f.cp.state().settings.log_level.as_deref(), Some("error"));

    // SPDK-internal calls: EOPNOTSUPP saying why.
    let r = gw
        .get_spdk_nvmf_log_flags_and_level(pb::GetSpdkNvmfLogFlagsAndLevelReq {})
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, EOPNOTSUPP);
    assert!(r.error_message.contains("no SPDK"), "{r:?}");
    for r in [
        gw.disable_spdk_nvmf_logs(pb::DisableSpdkNvmfLogsReq {})
            .await
            .expect("rpc")
            .into_inner(),
        gw.set_spdk_nvmf_logs(pb::SetSpdkNvmfLogsReq::default())
            .await
            .expect("rpc")
            .into_inner(),
        gw.set_ana_state(pb::AnaInfo::default())
            .await
            .expect("rpc")
            .into_inner(),
    ] {
        assert_eq!(r.status, EOPNOTSUPP, "{r:?}");
    }
}

/// A namespace's UUID is its own for its whole life: a client may name it (kept as named,
/// in canonical form), a deleted namespace's NSID given to another image brings another UUID,
/// and the same UUID is what the gateways are pushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_identities_are_chosen_once_and_never_reused() {
    let mut f = start().await;
    let gw = &mut f.gw;
    assert_eq!(
        gw.create_subsystem(pb::CreateSubsystemReq {
            subsystem_nqn: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner()
        .status,
        0
    );
    let uuid_of = |cp: &ControlPlane, nsid: u32| {
        cp.snapshot()
            .namespaces
            .get(&(NQN.to_string(), nsid))
            .map(|n| n.uuid.clone())
    };
    let mut named = namespace_req("img1", 512);
    named.uuid = Some("{8D6F1C5E-1A2B-4C3D-8E4F-506172839405}".into());
    let r = gw.namespace_add(named).await.expect("rpc").into_inner();
    assert_eq!((r.status, r.nsid), (0, 1), "{r:?}");
    assert_eq!(
        uuid_of(&f.cp, 1).as_deref(),
        Some("8d6f1c5e-1a2b-4c3d-8e4f-506172839405")
    );
    let pushed = f.cp.assignment("gw1").expect("assignment");
    let ns1 = pushed
        .namespaces
        .iter()
        .find(|n| n.nsid == 1)
        .expect("pushed");
    assert_eq!(
        (ns1.uuid.as_str(), ns1.nguid.as_str()),
        (
            "8d6f1c5e-1a2b-4c3d-8e4f-506172839405",
            "8d6f1c5e1a2b4c3d8e4f506172839405"
        )
    );

    // Deleted, and another image added under NSID 1: another UUID, listed and pushed.
    let r = gw
        .namespace_delete(pb::NamespaceDeleteReq {
            subsystem_nqn: NQN.into(),
            nsid: 1,
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let mut again = namespace_req("img2", 512);
    again.nsid = Some(1);
    let r = gw.namespace_add(again).await.expect("rpc").into_inner();
    assert_eq!((r.status, r.nsid), (0, 1), "{r:?}");
    let second = uuid_of(&f.cp, 1).expect("ns 1");
    assert_ne!(second, "8d6f1c5e-1a2b-4c3d-8e4f-506172839405");
    let listed = gw
        .list_namespaces(pb::ListNamespacesReq {
            subsystem: NQN.into(),
            nsid: Some(1),
            uuid: None,
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.namespaces[0].uuid, second);
    assert_eq!(listed.namespaces[0].rbd_image_name, "img2");
    let pushed = f.cp.assignment("gw1").expect("assignment");
    assert!(pushed
        .namespaces
        .iter()
        .any(|n| n.nsid == 1 && n.uuid == second));
}

/// `namespace_add` with `disable_auto_resize`: the namespace keeps its image's size at add
/// time (stored, pushed, listed); without it the namespace follows its image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_add_with_auto_resize_off_keeps_the_image_size() {
    let mut f = start().await;
    f.backend
        .sizes
        .lock()
        .expect("sizes")
        .insert("rbd/img2".into(), 2 * GIB);
    let gw = &mut f.gw;
    assert_eq!(
        gw.create_subsystem(subsystem_req(NQN))
            .await
            .expect("rpc")
            .get_ref()
            .status,
        0
    );
    let r = gw
        .namespace_add(namespace_req("img1", 512))
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let mut frozen = namespace_req("img2", 512);
    frozen.disable_auto_resize = Some(true);
    let r = gw.namespace_add(frozen).await.expect("rpc").into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let st = f.cp.state();
    assert_eq!(st.namespaces[&(NQN.to_string(), 1)].frozen_size, None);
    assert_eq!(
        st.namespaces[&(NQN.to_string(), r.nsid)].frozen_size,
        Some(2 * GIB)
    );
    let pushed = f.cp.assignment("gw1").expect("assignment");
    let sizes: Vec<(u32, u64)> = pushed
        .namespaces
        .iter()
        .map(|n| (n.nsid, n.frozen_size))
        .collect();
    assert_eq!(sizes, vec![(1, 0), (r.nsid, 2 * GIB)]);
    let listed = gw
        .list_namespaces(pb::ListNamespacesReq {
            subsystem: NQN.into(),
            nsid: None,
            uuid: None,
        })
        .await
        .expect("list")
        .into_inner();
    let flags: Vec<(u32, Option<bool>)> = listed
        .namespaces
        .iter()
        .map(|n| (n.nsid, n.disable_auto_resize))
        .collect();
    assert_eq!(flags, vec![(1, Some(false)), (r.nsid, Some(true))]);
}
