//! Configuration from the control plane: a gateway whose file has no subsystem at all serves
//! what the admin API put in RADOS, picks up a namespace added later (the host sees it after
//! the Namespace Attribute Changed event), a resize, a namespace moved to another gateway's
//! ANA group (and back to optimized here once that gateway is fenced), the group's listeners
//! in its discovery log, and serves it all again after a restart.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test group_config -- --ignored --nocapture
//! ```

mod common;

use std::time::Duration;

use common::ceph::{ceph_conf, create_image_pair, pool, remove_from_blocklist, remove_image};
use common::control::{
    add_namespace_once_its_group_exists, admin_client, channel, start_rados_control_plane,
};
use common::gateway_process::spawn_gw1_configured_by;
use common::host::{
    connect_within, discovery_entries, wait_for_ana_states, wait_for_namespaces, Attach, HostQueues,
};
use common::{free_port, poll_until, scratch_dir, unique_tag};
use control_plane::proto;
use nvmeof_gateway::spec::ana;

const SUBNQN: &str = "nqn.2016-06.io.test:pushed";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000f1";

/// Admin + one I/O queue, retried until the subsystem is served.
async fn connect(port: u16) -> HostQueues {
    connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(30)).await
}

async fn wait_optimized(admin: &nvmeof_gateway::host::HostConnection, group: u32) {
    wait_for_ana_states(admin, &[(group, ana::OPTIMIZED)], Duration::from_secs(20)).await
}

/// The ports the discovery log of the gateway on `port` lists for the subsystem.
async fn discovery_ports(port: u16) -> Vec<String> {
    discovery_entries(port, HOSTNQN)
        .await
        .iter()
        .filter(|e| e.subnqn == SUBNQN)
        .map(|e| e.trsvcid.trim().to_string())
        .collect()
}

/// The NGUID the control plane lists for namespace `nsid` (hex, as stored).
async fn listed_nguid(
    admin: &mut proto::admin_client::AdminClient<tonic::transport::Channel>,
    nsid: u32,
) -> String {
    admin
        .namespace_list(proto::NamespaceListRequest {
            subsystem_nqn: SUBNQN.into(),
        })
        .await
        .expect("namespace list")
        .into_inner()
        .namespaces
        .into_iter()
        .find(|n| n.nsid == nsid)
        .map(|n| n.nguid)
        .unwrap_or_default()
}

/// The NGUID the host reads in Identify Namespace, as hex.
async fn served_nguid(admin: &nvmeof_gateway::host::HostConnection, nsid: u32) -> String {
    let nguid = admin
        .identify_namespace(nsid)
        .await
        .expect("identify namespace")
        .nguid();
    nguid.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn a_gateway_serves_what_the_control_plane_stores() {
    ceph_conf();
    let name = format!("pushed-{}", unique_tag());
    let images = create_image_pair(&name, "16M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane(&name, 200).await;
    let cp_addr = control.addr;

    // The admin API: a subsystem and namespace 1 (the gateway registers group 1 first).
    let port = free_port();
    let gw = spawn_gw1_configured_by(&dir, port, &cp_addr);
    let mut admin = admin_client(&cp_addr).await;
    admin
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: SUBNQN.into(),
            allow_any_host: true,
            ..Default::default()
        })
        .await
        .expect("subsystem");
    // Group 1 exists once gw1 has beaconed.
    add_namespace_once_its_group_exists(
        &mut admin,
        proto::NamespaceAddRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 1,
            pool: pool(),
            image: images[0].clone(),
            ana_group: 1,
            ..Default::default()
        },
    )
    .await;
    let HostQueues {
        admin: h_admin,
        io: h_io,
    } = connect(port).await;
    wait_for_namespaces(&h_admin, &[1]).await;
    wait_optimized(&h_admin, 1).await;
    // The gateway reports the host's controller in its beacons.
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(100),
        async || {
            let c = admin
                .connection_list(proto::ConnectionListRequest::default())
                .await
                .expect("connections")
                .into_inner();
            if c.connections
                .iter()
                .any(|c| c.gateway == "gw1" && c.host_nqn == HOSTNQN && c.cntlid >= 1)
            {
                Ok(())
            } else {
                Err(format!("connection not reported: {c:?}"))
            }
        },
    )
    .await;
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    h_io.write(1, 0, data.clone(), 512)
        .await
        .expect("write ns 1");

    // A namespace added later appears without reconnecting.
    admin
        .namespace_add(proto::NamespaceAddRequest {
            subsystem_nqn: SUBNQN.into(),
            pool: pool(),
            image: images[1].clone(),
            ana_group: 1,
            ..Default::default()
        })
        .await
        .expect("namespace 2");
    wait_for_namespaces(&h_admin, &[1, 2]).await;
    h_io.write(2, 0, data.clone(), 512)
        .await
        .expect("write ns 2");
    // Each namespace is served with the identity the control plane stored for it.
    let ids = [
        served_nguid(&h_admin, 1).await,
        served_nguid(&h_admin, 2).await,
    ];
    assert_eq!(ids[0], listed_nguid(&mut admin, 1).await);
    assert_eq!(ids[1], listed_nguid(&mut admin, 2).await);
    assert_ne!(ids[0], ids[1]);

    // Resize through the admin API: grow only; the host sees the new size.
    let shrink = admin
        .namespace_resize(proto::NamespaceResizeRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
            size_bytes: 8 << 20,
        })
        .await;
    assert_eq!(
        shrink.err().map(|s| s.code()),
        Some(tonic::Code::InvalidArgument)
    );
    admin
        .namespace_resize(proto::NamespaceResizeRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
            size_bytes: 32 << 20,
        })
        .await
        .expect("grow");
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let nsze = h_admin
                .identify_namespace(2)
                .await
                .expect("identify")
                .nsze();
            if nsze == (32 << 20) / 512 {
                Ok(())
            } else {
                Err("the host never saw the new size".to_string())
            }
        },
    )
    .await;

    // A second gateway (a gRPC client beaconing like one) owns group 2; namespace 2 moves
    // there: on gw1 its ANAGRPID becomes 2 and its path inaccessible. When the second
    // gateway goes silent it is fenced and group 2 becomes optimized on gw1.
    let fake_addr = format!("127.0.0.1:0/{}", 800_000 + port as u32);
    let beacons = {
        let mut g =
            proto::gateway_control_client::GatewayControlClient::new(channel(&cp_addr).await);
        let fake_addr = fake_addr.clone();
        tokio::spawn(async move {
            loop {
                let _ = g
                    .send_beacon(proto::Beacon {
                        gateway: "gw2".into(),
                        ana_group: 2,
                        incarnation: 99,
                        client_addrs: vec![fake_addr.clone()],
                        applied_version: u64::MAX,
                        connections: vec![],
                        cluster: 0,
                        osds_unanswered: vec![],
                        osd_probe: None,
                    })
                    .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // Not Found until the control plane has had gw2's first beacon (group 2 exists).
    let msg = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let r = admin
                .namespace_move(proto::NamespaceMoveRequest {
                    subsystem_nqn: SUBNQN.into(),
                    nsid: 2,
                    ana_group: 2,
                })
                .await;
            match r {
                Ok(reply) => Ok(reply.into_inner().message),
                Err(s) if s.code() == tonic::Code::NotFound => Err(format!("move: {s}")),
                Err(s) => panic!("move: {s}"),
            }
        },
    )
    .await;
    // The control plane ended the move only once gw1 (serving the old group) acknowledged
    // it, its commands in flight done.
    assert!(msg.contains("drained on gw1"), "{msg}");
    eprintln!("move: {msg}");
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let raw = h_admin.identify_namespace(2).await.expect("identify").raw;
            if u32::from_le_bytes([raw[92], raw[93], raw[94], raw[95]]) == 2 {
                Ok(())
            } else {
                Err("ANAGRPID never 2".to_string())
            }
        },
    )
    .await;
    assert!(
        h_io.write(2, 0, data.clone(), 512).await.is_err(),
        "gw1 wrote namespace 2 while its group is on gw2"
    );
    beacons.abort();
    wait_optimized(&h_admin, 2).await;
    h_io.write(2, 0, data.clone(), 512)
        .await
        .expect("write ns 2 after gw2 was fenced");
    assert_eq!(
        served_nguid(&h_admin, 2).await,
        ids[1],
        "identity changed by a move and a failover"
    );
    remove_from_blocklist(&fake_addr);

    // Listeners registered for the group (this gateway's and another's) are all in this
    // gateway's discovery log.
    for (gw, port) in [("gw1", port), ("gw2", 4999)] {
        admin
            .listener_add(proto::Listener {
                subsystem_nqn: SUBNQN.into(),
                gateway: gw.into(),
                transport: "tcp".into(),
                address: "127.0.0.1".into(),
                port: u32::from(port),
                secure: false,
            })
            .await
            .expect("listener");
    }
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(200),
        async || {
            let ports = discovery_ports(port).await;
            if ports.contains(&port.to_string()) && ports.contains(&"4999".to_string()) {
                assert_eq!(ports.len(), 2, "{ports:?}");
                Ok(())
            } else {
                Err(format!("discovery log ports {ports:?}"))
            }
        },
    )
    .await;

    // A listener added for this gateway is listened on; deleted, it stops (new connections
    // refused) while the file's listener keeps serving.
    let extra = free_port();
    let extra_listener = proto::Listener {
        subsystem_nqn: SUBNQN.into(),
        gateway: "gw1".into(),
        transport: "tcp".into(),
        address: "127.0.0.1".into(),
        port: u32::from(extra),
        secure: false,
    };
    admin
        .listener_add(extra_listener.clone())
        .await
        .expect("listener add");
    let HostQueues {
        admin: x_admin,
        io: x_io,
    } = connect(extra).await;
    assert_eq!(x_io.read(1, 0, 8, 512).await.expect("read ns 1"), data);
    admin
        .listener_del(extra_listener)
        .await
        .expect("listener del");
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || match tokio::net::TcpStream::connect(("127.0.0.1", extra)).await {
            Ok(_) => Err(format!("still listening on {extra} after listener del")),
            Err(_) => Ok(()),
        },
    )
    .await;
    assert!(
        x_io.read(1, 0, 8, 512).await.is_err(),
        "a connection through the deleted listener still works"
    );
    drop((x_admin, x_io));
    // Deleted listeners leave the discovery log: this gateway's (just stopped) and another
    // gateway's (gw2's 4999).
    admin
        .listener_del(proto::Listener {
            subsystem_nqn: SUBNQN.into(),
            gateway: "gw2".into(),
            transport: "tcp".into(),
            address: "127.0.0.1".into(),
            port: 4999,
            secure: false,
        })
        .await
        .expect("listener del gw2");
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(200),
        async || {
            let ports = discovery_ports(port).await;
            if ports == [port.to_string()] {
                Ok(())
            } else {
                Err(format!("discovery log ports after listener del: {ports:?}"))
            }
        },
    )
    .await;
    assert_eq!(
        h_io.read(1, 0, 8, 512)
            .await
            .expect("read via the file's listener"),
        data
    );

    // Restart (SIGTERM: the only gateway has no one to move its groups to, so it stops at
    // once); everything comes back from RADOS.
    drop(h_io);
    drop(h_admin);
    let mut gw = gw;
    gw.signal("-TERM");
    let status = gw
        .exit_within(
            Duration::from_secs(5),
            "the lone gateway waited for a move that cannot happen",
        )
        .await;
    assert!(status.success(), "{status}");
    drop(gw);
    let gw = spawn_gw1_configured_by(&dir, port, &cp_addr);
    let HostQueues {
        admin: h_admin,
        io: h_io,
    } = connect(port).await;
    wait_for_namespaces(&h_admin, &[1, 2]).await;
    wait_optimized(&h_admin, 1).await;
    // Group 2 stayed with gw1 (gw2 is fenced), as stored in RADOS.
    wait_optimized(&h_admin, 2).await;
    assert_eq!(h_io.read(1, 0, 8, 512).await.expect("read ns 1"), data);
    assert_eq!(h_io.read(2, 0, 8, 512).await.expect("read ns 2"), data);
    for (nsid, id) in [(1, &ids[0]), (2, &ids[1])] {
        assert_eq!(
            served_nguid(&h_admin, nsid).await,
            *id,
            "identity changed by a gateway restart"
        );
    }
    // Another replica of the control plane (a restart) loads the same identities from RADOS.
    let replica = common::control::start_rados_control_plane(&name, 200).await;
    let mut replica_admin = admin_client(&replica.addr).await;
    assert_eq!(listed_nguid(&mut replica_admin, 1).await, ids[0]);
    assert_eq!(listed_nguid(&mut replica_admin, 2).await, ids[1]);

    // Namespace 2 deleted and another (new, empty) image added under NSID 2 while the host
    // is connected: the host finds another identity there, and the new image's data, not
    // the old one's.
    admin
        .namespace_del(proto::NamespaceDelRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
            ..Default::default()
        })
        .await
        .expect("namespace del");
    let third = format!("{name}-3");
    admin
        .namespace_add(proto::NamespaceAddRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
            pool: pool(),
            image: third.clone(),
            ana_group: 1,
            create_image: true,
            size_bytes: 16 << 20,
            ..Default::default()
        })
        .await
        .expect("another image as namespace 2");
    let reused = listed_nguid(&mut admin, 2).await;
    assert_ne!(
        reused, ids[1],
        "the new image got the old namespace's NGUID"
    );
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        async || {
            let served = h_admin.identify_namespace(2).await.map(|n| {
                n.nguid()
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            });
            match served {
                Ok(g) if g == reused => Ok(()),
                other => Err(format!("NSID 2 served as {other:?}, want {reused}")),
            }
        },
    )
    .await;
    assert_eq!(
        h_io.read(2, 0, 8, 512).await.expect("read the new ns 2"),
        vec![0u8; 4096],
        "NSID 2 still reads the old image"
    );

    drop(h_io);
    drop(h_admin);
    drop(gw);
    for i in images.iter().chain([&third]) {
        remove_image(i);
    }
    let _ = std::fs::remove_dir_all(dir);
}
