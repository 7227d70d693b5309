//! ceph-nvmeof's `namespace_get_io_stats` and `get_gateway_stats`, and the Admin API's
//! `NamespaceIoStats` (`nvmeofctl namespace stats`), over the wire against a replica with its
//! state in memory, fed by group beacons carrying I/O counters as gateways send them: the
//! totals sum the gateways that served a namespace, never go down across a failover and a
//! gateway restart, leave out counters reported under another namespace's UUID, and bad
//! input gets ceph-nvmeof's errno with the state unchanged. A real gateway doing I/O is in
//! gateway/tests/group_io_stats.rs.

use std::time::Duration;

use control_plane::ana::Timing;
use control_plane::ceph_proto as pb;
use control_plane::ceph_proto::gateway_client::GatewayClient;
use control_plane::proto;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::server::{ControlPlane, Options};
use control_plane::state::GroupState;
use control_plane::store::Store;
use control_plane::test_support::{self, plain_channel};
use tonic::transport::Channel;

mod common;

const NQN: &str = "nqn.2016-06.io.test:stats";

const ENOENT: i32 = 2;
const ENODEV: i32 = 19;
const EINVAL: i32 = 22;

struct Fixture {
    addr: String,
    cp: std::sync::Arc<ControlPlane>,
    gw: GatewayClient<Channel>,
    admin: AdminClient<Channel>,
    control: GatewayControlClient<Channel>,
}

async fn start() -> Fixture {
    let backend = test_support::memory_backend_with_images(["rbd/img1".to_string()]);
    let options = Options {
        timing: Timing {
            grace_ms: 5_000,
            failback_delay_ms: 200,
        },
        lease: Duration::from_secs(3),
        tick: Duration::from_millis(50),
    };
    let cp = test_support::start_replica(Store::new(backend), "stats-test", options).await;
    let addr = test_support::serve_plain(cp.clone()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(5)).await;
    let mut f = Fixture {
        addr: addr.clone(),
        cp,
        gw: GatewayClient::new(plain_channel(&addr).await),
        admin: AdminClient::new(plain_channel(&addr).await),
        control: GatewayControlClient::new(plain_channel(&addr).await),
    };
    // gw1 owns group 1 (a namespace goes to an existing group).
    beacon(&mut f.control, "gw1", 1, 1, vec![], None).await;
    f
}

/// A group beacon of `gateway` (owning group `group`) from process `incarnation`, with
/// these namespaces' counters of NQN and these queue totals.
async fn beacon(
    c: &mut GatewayControlClient<Channel>,
    gateway: &str,
    group: u32,
    incarnation: u64,
    namespaces: Vec<proto::NamespaceIoCounters>,
    totals: Option<proto::GatewayIoTotals>,
) {
    c.send_group_beacon(proto::GroupBeacon {
        beacon: Some(proto::Beacon {
            gateway: gateway.into(),
            ana_group: group,
            incarnation,
            client_addrs: vec![format!("127.0.0.1:0/{group}")],
            ..Default::default()
        }),
        io_counters: if namespaces.is_empty() {
            vec![]
        } else {
            vec![proto::SubsystemIoCounters {
                nqn: NQN.into(),
                namespaces,
            }]
        },
        io_totals: totals,
        ..Default::default()
    })
    .await
    .expect("beacon");
}

/// Namespace 1's counters as a gateway reports them: `reads` 4 KiB reads of 100 us each
/// (one of 300 us), `writes` 8 KiB writes of 1 ms each, under `uuid`.
fn counters(uuid: &[u8], reads: u64, writes: u64) -> proto::NamespaceIoCounters {
    proto::NamespaceIoCounters {
        nsid: 1,
        uuid: uuid.to_vec(),
        read: (reads > 0).then(|| proto::OpCounters {
            ops: reads,
            bytes: reads * 4096,
            latency_ns: reads * 100_000 + 200_000,
            max_latency_ns: 300_000,
            min_latency_ns: 100_000,
            failed: 0,
        }),
        write: (writes > 0).then(|| proto::OpCounters {
            ops: writes,
            bytes: writes * 8192,
            latency_ns: writes * 1_000_000,
            max_latency_ns: 1_000_000,
            min_latency_ns: 1_000_000,
            failed: 1,
        }),
        ..Default::default()
    }
}

async fn io_stats(
    gw: &mut GatewayClient<Channel>,
    nqn: &str,
    nsid: u32,
) -> pb::NamespaceIoStatsInfo {
    gw.namespace_get_io_stats(pb::NamespaceGetIoStatsReq {
        subsystem_nqn: nqn.into(),
        nsid,
        ..Default::default()
    })
    .await
    .expect("rpc")
    .into_inner()
}

fn config(cp: &ControlPlane) -> GroupState {
    let mut st = cp.state();
    st.map = None;
    st
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_stats_sum_the_gateways_and_never_go_down() {
    let mut f = start().await;
    let r =
        f.gw.create_subsystem(pb::CreateSubsystemReq {
            subsystem_nqn: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let r =
        f.gw.namespace_add(pb::NamespaceAddReq {
            subsystem_nqn: NQN.into(),
            rbd_pool_name: "rbd".into(),
            rbd_image_name: "img1".into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!((r.status, r.nsid), (0, 1), "{r:?}");
    let listed =
        f.gw.list_namespaces(pb::ListNamespacesReq {
            subsystem: NQN.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    let uuid_text = listed.namespaces[0].uuid.clone();
    let uuid = uuid::Uuid::parse_str(&uuid_text).expect("a UUID");
    let uuid = uuid.as_bytes();

    // gw1 serves it: 100 reads, 10 writes (one failed).
    beacon(
        &mut f.control,
        "gw1",
        1,
        1,
        vec![counters(uuid, 100, 10)],
        Some(proto::GatewayIoTotals {
            admin_queues: 1,
            io_queues: 4,
        }),
    )
    .await;
    let s = io_stats(&mut f.gw, NQN, 1).await;
    assert_eq!(s.status, 0, "{s:?}");
    assert_eq!((s.subsystem_nqn.as_str(), s.nsid), (NQN, 1));
    assert_eq!(s.uuid.as_deref(), Some(uuid_text.as_str()));
    assert_eq!(s.bdev_name, "rbd/img1");
    assert_eq!(s.tick_rate, 1_000_000_000);
    assert!(
        s.ticks > 1_700_000_000 * 1_000_000_000,
        "ticks: {}",
        s.ticks
    );
    assert_eq!(
        (
            s.num_read_ops,
            s.bytes_read,
            s.num_write_ops,
            s.bytes_written
        ),
        (100, 409_600, 10, 81_920)
    );
    assert_eq!(
        (
            s.read_latency_ticks,
            s.max_read_latency_ticks,
            s.min_read_latency_ticks
        ),
        (10_200_000, 300_000, 100_000)
    );
    assert_eq!(s.write_latency_ticks, 10_000_000);
    assert_eq!(
        s.io_error
            .iter()
            .map(|e| (e.name.as_str(), e.value))
            .collect::<Vec<_>>(),
        [("write", 1)]
    );

    // Failover: gw1 is gone, gw2 serves the namespace and counts from 0; the totals keep
    // gw1's counts.
    beacon(
        &mut f.control,
        "gw2",
        2,
        7,
        vec![counters(uuid, 5, 0)],
        None,
    )
    .await;
    let s = io_stats(&mut f.gw, NQN, 1).await;
    assert_eq!((s.num_read_ops, s.num_write_ops), (105, 10), "{s:?}");
    // gw1 restarted (new incarnation, counters from 0) and got the namespace back.
    beacon(
        &mut f.control,
        "gw1",
        1,
        2,
        vec![counters(uuid, 3, 0)],
        Some(proto::GatewayIoTotals {
            admin_queues: 1,
            io_queues: 2,
        }),
    )
    .await;
    let s = io_stats(&mut f.gw, NQN, 1).await;
    assert_eq!(
        (s.num_read_ops, s.bytes_read, s.num_write_ops),
        (108, 108 * 4096, 10),
        "{s:?}"
    );
    // A report for another namespace once under that NSID (another UUID) is not this one's.
    beacon(
        &mut f.control,
        "gw3",
        3,
        1,
        vec![counters(&[0x5a; 16], 1_000, 0)],
        None,
    )
    .await;
    assert_eq!(io_stats(&mut f.gw, NQN, 1).await.num_read_ops, 108);

    // The Admin API (nvmeofctl namespace stats): the same totals, and each gateway's share.
    let a = f
        .admin
        .namespace_io_stats(proto::NamespaceIoStatsRequest {
            subsystem_nqn: NQN.into(),
            nsid: 1,
        })
        .await
        .expect("admin stats")
        .into_inner();
    let total = a.total.expect("a total");
    assert_eq!(total.read.expect("reads").ops, 108);
    assert_eq!(total.uuid, uuid.to_vec());
    let shares: Vec<(String, u64)> = a
        .gateways
        .iter()
        .map(|g| {
            let reads = g.counters.as_ref().and_then(|c| c.read.as_ref());
            (g.gateway.clone(), reads.map_or(0, |r| r.ops))
        })
        .collect();
    assert_eq!(shares, [("gw1".to_string(), 103), ("gw2".to_string(), 5)]);

    // nvmeofctl namespace stats: a row per gateway and the total; JSON as the reply.
    let (code, table, err) =
        common::ctl(&f.addr, &["namespace", "stats", "-n", NQN, "--nsid", "1"]);
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows[0][..3], ["GATEWAY", "READS", "READ"], "{table}");
    assert_eq!(rows[1][..4], ["gw1", "103", "421888", "10"], "{table}");
    assert_eq!(rows[2][..4], ["gw2", "5", "20480", "0"], "{table}");
    assert_eq!(rows[3][..4], ["(total)", "108", "442368", "10"], "{table}");
    let (code, text, err) = common::ctl(
        &f.addr,
        &["-o", "json", "namespace", "stats", "-n", NQN, "--nsid", "1"],
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["total"]["read"]["ops"], 108, "{text}");
    assert_eq!(v["total"]["write"]["failed"], 1, "{text}");
    let (code, _, err) = common::ctl(&f.addr, &["namespace", "stats", "-n", NQN, "--nsid", "9"]);
    assert_eq!(code, 1, "no namespace 9: {err}");

    // get_gateway_stats: one poll group per gateway, queues summed over gw1's restarts.
    let g =
        f.gw.get_gateway_stats(pb::GetGatewayStatsReq {})
            .await
            .expect("rpc")
            .into_inner();
    assert_eq!((g.status, g.tick_rate), (0, 1_000_000_000), "{g:?}");
    let gw1 = g
        .poll_groups
        .iter()
        .find(|p| p.name == "gw1")
        .expect("gw1's poll group");
    assert_eq!(
        (gw1.admin_qpairs, gw1.io_qpairs, gw1.completed_nvme_io),
        (2, 6, 113)
    );
    let gw2 = g.poll_groups.iter().find(|p| p.name == "gw2").expect("gw2");
    assert_eq!(gw2.completed_nvme_io, 5);

    // Bad input: ceph-nvmeof's errnos, nothing changes.
    let before = config(&f.cp);
    let s = io_stats(&mut f.gw, NQN, 0).await;
    assert_eq!(s.status, EINVAL, "{s:?}");
    assert!(s.error_message.contains("missing ID"), "{s:?}");
    let s = io_stats(&mut f.gw, "", 1).await;
    assert_eq!(s.status, EINVAL, "{s:?}");
    let s = io_stats(&mut f.gw, "nqn.2016-06.io.test:nope", 1).await;
    assert_eq!(s.status, ENOENT, "{s:?}");
    assert!(
        s.error_message.contains("nqn.2016-06.io.test:nope"),
        "{s:?}"
    );
    let s = io_stats(&mut f.gw, NQN, 9).await;
    assert_eq!(s.status, ENODEV, "{s:?}");
    assert_eq!(config(&f.cp), before, "a refusal changed the state");
    let missing = f
        .admin
        .namespace_io_stats(proto::NamespaceIoStatsRequest {
            subsystem_nqn: NQN.into(),
            nsid: 9,
        })
        .await
        .expect_err("no namespace 9");
    assert_eq!(missing.code(), tonic::Code::NotFound);

    // Deleted: ENODEV; its counters are forgotten at the next beacon, so a namespace added
    // again under NSID 1 starts from 0.
    let r =
        f.gw.namespace_delete(pb::NamespaceDeleteReq {
            subsystem_nqn: NQN.into(),
            nsid: 1,
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(io_stats(&mut f.gw, NQN, 1).await.status, ENODEV);
    beacon(&mut f.control, "gw2", 2, 7, vec![], None).await;
    let r =
        f.gw.namespace_add(pb::NamespaceAddReq {
            subsystem_nqn: NQN.into(),
            rbd_pool_name: "rbd".into(),
            rbd_image_name: "img1".into(),
            nsid: Some(1),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!((r.status, r.nsid), (0, 1), "{r:?}");
    let s = io_stats(&mut f.gw, NQN, 1).await;
    assert_eq!(
        (s.status, s.num_read_ops, s.num_write_ops),
        (0, 0, 0),
        "{s:?}"
    );
}
