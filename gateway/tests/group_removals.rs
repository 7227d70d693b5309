//! Removals made in the control plane reach a running gateway: `namespace del` (the host gets
//! Namespace Attribute Changed, the Changed Namespace List names the NSID, the namespace is
//! gone), `host del` (that host's controller is closed and its new Connects are refused with
//! Connect Invalid Host) and `subsystem del` (its controllers closed, gone from the discovery
//! log, Connects refused). Requests go through the admin gRPC API, as `nvmeofctl` sends them.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test group_removals -- --ignored --nocapture
//! ```

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::ceph::{ceph_conf, create_image_pair, image_spec, pool, remove_image};
use common::control::{
    add_namespace_once_its_group_exists, admin_client, start_rados_control_plane,
};
use common::gateway_process::spawn_gw1_configured_by;
use common::host::{discovery_entries, try_connect_admin, wait_for_namespaces, Attach};
use common::{free_port, loopback, poll_until, scratch_dir, unique_tag};
use control_plane::proto;
use nvmeof_gateway::host::{HostConnection, HostError, HostOptions, Sqe, Xfer};
use nvmeof_gateway::spec::{admin_opcode, aer, feat, log, sc};

const SUBNQN: &str = "nqn.2016-06.io.test:removals";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000a1";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000b2";

/// Watchers on an image (an open librbd image holds one).
fn watchers(image: &str) -> usize {
    let out = Command::new("rbd")
        .args(["status", "--format", "json", &image_spec(image)])
        .output()
        .expect("rbd status");
    assert!(out.status.success(), "rbd status {image}");
    let text = String::from_utf8_lossy(&out.stdout);
    text.matches("\"address\"").count()
}

/// An admin queue of `host` on the subsystem, enabled; retried for up to 30 s.
async fn admin_queue(port: u16, host: &str) -> HostConnection {
    let mut attach = Attach::new(host, SUBNQN);
    attach.command_timeout = Duration::from_secs(30);
    poll_until(
        Duration::from_secs(30),
        Duration::from_millis(200),
        async || {
            try_connect_admin(loopback(port), &attach)
                .await
                .map(|(admin, _)| admin)
                .map_err(|e| format!("{host} cannot connect to {SUBNQN}: {e}"))
        },
    )
    .await
}

/// Status (SCT and SC, as `spec::sc` spells them) of a refused Connect (panics if it was accepted or failed otherwise).
async fn refused_connect(port: u16, host: &str) -> u16 {
    let c = HostConnection::connect(loopback(port), HostOptions::new(host))
        .await
        .expect("TCP connection");
    match c.connect_admin(SUBNQN, 120_000).await {
        Err(HostError::Nvme(cqe)) => (u16::from(cqe.sct()) << 8) | u16::from(cqe.sc()),
        other => panic!("{host}: connect not refused with a status: {other:?}"),
    }
}

/// The subsystems the discovery log lists for `host`.
async fn discovery_subsystems(port: u16, host: &str) -> Vec<String> {
    discovery_entries(port, host)
        .await
        .into_iter()
        .map(|e| e.subnqn)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn removals_in_the_control_plane_reach_a_running_gateway() {
    ceph_conf();
    let name = format!("removals-{}", unique_tag());
    let images = create_image_pair(&name, "16M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane(&name, 200).await;
    let cp_addr = control.addr;

    let port = free_port();
    let _gw = spawn_gw1_configured_by(&dir, port, &cp_addr);
    let mut admin = admin_client(&cp_addr).await;
    admin
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: SUBNQN.into(),
            allow_any_host: false,
            ..Default::default()
        })
        .await
        .expect("subsystem");
    for host in [HOST_A, HOST_B] {
        admin
            .host_add(proto::Host {
                subsystem_nqn: SUBNQN.into(),
                host_nqn: host.into(),
                ..Default::default()
            })
            .await
            .expect("host add");
    }
    for (nsid, image) in [(1u32, &images[0]), (2, &images[1])] {
        // Group 1 exists once gw1 has beaconed.
        add_namespace_once_its_group_exists(
            &mut admin,
            proto::NamespaceAddRequest {
                subsystem_nqn: SUBNQN.into(),
                nsid,
                pool: pool(),
                image: image.clone(),
                ana_group: 1,
                ..Default::default()
            },
        )
        .await;
    }

    // Host A with Namespace Attribute Notices enabled and an AER outstanding.
    let a = admin_queue(port, HOST_A).await;
    wait_for_namespaces(&a, &[1, 2]).await;
    // Whatever notices the adds raised are consumed first (read with RAE = 0).
    let _ = a.get_log_page(log::CHANGED_NS, 0, 4096, 0).await;
    let mut set = Sqe::new(admin_opcode::SET_FEATURES);
    set.set_cdw(10, u32::from(feat::ASYNC_EVENT))
        .set_cdw(11, aer::CFG_NS_ATTR);
    a.submit_ok(set, Xfer::None)
        .await
        .expect("async event config");
    let aer_cmd = a
        .start(Sqe::new(admin_opcode::ASYNC_EVENT), Xfer::None)
        .await
        .expect("AER");

    // namespace del: the event, the changed list, the namespace gone; NSID 1 unaffected.
    let deleted = Instant::now();
    admin
        .namespace_del(proto::NamespaceDelRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
            ..Default::default()
        })
        .await
        .expect("namespace del");
    let event = aer_cmd.wait().await.expect("AER completed");
    eprintln!(
        "AER {:#08x} {} ms after namespace del",
        event.cqe.dw0(),
        deleted.elapsed().as_millis()
    );
    assert!(event.cqe.is_success());
    assert_eq!(
        event.cqe.dw0(),
        u32::from(aer::TYPE_NOTICE)
            | (u32::from(aer::NOTICE_NS_CHANGED) << 8)
            | (u32::from(log::CHANGED_NS) << 16)
    );
    let list = a
        .get_log_page(log::CHANGED_NS, 0, 4096, 0)
        .await
        .expect("changed namespace list");
    let first = u32::from_le_bytes([list[0], list[1], list[2], list[3]]);
    assert_eq!(first, 2, "the changed list names NSID 2");
    assert_eq!(a.active_namespaces(0).await.expect("list"), vec![1]);
    let io = {
        let o = HostOptions::new(HOST_A);
        let io = HostConnection::connect(loopback(port), o)
            .await
            .expect("io connection");
        let cntlid = a.identify_controller().await.expect("identify").cntlid();
        io.connect_io(SUBNQN, cntlid, 1, 31)
            .await
            .expect("io queue");
        io
    };
    assert!(io.read(2, 0, 8, 512).await.is_err(), "NSID 2 still reads");
    // Its image was closed: no watcher left on it (NSID 1's image keeps one).
    assert!(watchers(&images[0]) > 0, "the check sees an open image");
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || match watchers(&images[1]) {
            0 => Ok(()),
            _ => Err("the deleted namespace's image is still open".to_string()),
        },
    )
    .await;
    io.read(1, 0, 8, 512).await.expect("NSID 1 reads");

    // host del: A's controller is closed, A cannot come back, B can connect.
    let b = admin_queue(port, HOST_B).await;
    admin
        .host_del(proto::Host {
            subsystem_nqn: SUBNQN.into(),
            host_nqn: HOST_A.into(),
            ..Default::default()
        })
        .await
        .expect("host del");
    assert!(
        a.wait_closed(Duration::from_secs(10)).await,
        "the removed host's admin queue stayed open"
    );
    assert!(
        io.wait_closed(Duration::from_secs(10)).await,
        "its I/O queue stayed open"
    );
    assert_eq!(
        refused_connect(port, HOST_A).await,
        sc::CONNECT_INVALID_HOST
    );
    assert_eq!(
        b.active_namespaces(0).await.expect("B still served"),
        vec![1]
    );

    // subsystem del: B's controller closed, gone from the discovery log, Connects refused.
    assert!(discovery_subsystems(port, HOST_B)
        .await
        .iter()
        .any(|n| n == SUBNQN));
    assert!(
        !discovery_subsystems(port, HOST_A)
            .await
            .iter()
            .any(|n| n == SUBNQN),
        "listed for the removed host"
    );
    admin
        .subsystem_del(proto::SubsystemDelRequest {
            nqn: SUBNQN.into(),
            force: true,
        })
        .await
        .expect("subsystem del");
    assert!(
        b.wait_closed(Duration::from_secs(10)).await,
        "a controller of the deleted subsystem stayed open"
    );
    assert!(!discovery_subsystems(port, HOST_B)
        .await
        .iter()
        .any(|n| n == SUBNQN));
    assert_eq!(
        refused_connect(port, HOST_B).await,
        sc::CONNECT_INVALID_PARAM
    );

    for i in &images {
        remove_image(i);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `namespace del --delete-image` right after the last host disconnected (issue 51: refused
/// for about 2 s, "hosts are connected", as the control plane judged from the gateway's last
/// beacon). While host A is connected the deletion is refused and the image stays; A shuts
/// its controller down and closes its connection as Linux's `nvme disconnect` does, and the
/// deletion sent at once succeeds: the gateway beacons the disconnect at once, and the
/// control plane waits for fresh beacons before it would refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn an_image_is_deleted_right_after_its_last_host_disconnects() {
    ceph_conf();
    let name = format!("del-after-disc-{}", unique_tag());
    let images = create_image_pair(&name, "16M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane(&name, 200).await;
    let port = free_port();
    let _gw = spawn_gw1_configured_by(&dir, port, &control.addr);
    let mut admin = admin_client(&control.addr).await;
    admin
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: SUBNQN.into(),
            allow_any_host: true,
            ..Default::default()
        })
        .await
        .expect("subsystem");
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
    let del = proto::NamespaceDelRequest {
        subsystem_nqn: SUBNQN.into(),
        nsid: 1,
        delete_image: true,
        force: false,
    };

    let a = admin_queue(port, HOST_A).await;
    wait_for_namespaces(&a, &[1]).await;
    let mut cp = admin.clone();
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let listed = cp
                .connection_list(proto::ConnectionListRequest {
                    subsystem_nqn: SUBNQN.into(),
                })
                .await
                .map_err(|e| e.to_string())?
                .into_inner()
                .connections;
            match listed.iter().any(|c| c.host_nqn == HOST_A) {
                true => Ok(()),
                false => Err(format!("host A not beaconed yet: {listed:?}")),
            }
        },
    )
    .await;
    let refused = admin
        .namespace_del(del.clone())
        .await
        .expect_err("host A is connected");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains(HOST_A), "{}", refused.message());
    assert!(
        String::from_utf8_lossy(&common::ceph::rbd(&["ls", &pool()]))
            .lines()
            .any(|l| l == images[0]),
        "the image was removed while its host was connected"
    );

    a.shutdown_controller().await.expect("CC.SHN");
    a.close().await;
    let t0 = Instant::now();
    admin
        .namespace_del(del)
        .await
        .expect("deleted right after the last host disconnected");
    eprintln!(
        "namespace and image deleted {} ms after the host's disconnect",
        t0.elapsed().as_millis()
    );
    assert!(
        !String::from_utf8_lossy(&common::ceph::rbd(&["ls", &pool()]))
            .lines()
            .any(|l| l == images[0]),
        "the image is still there"
    );
    remove_image(&images[1]);
}
