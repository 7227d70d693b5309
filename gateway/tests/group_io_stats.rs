//! A group gateway's I/O reaches ceph-nvmeof's `namespace_get_io_stats` and
//! `get_gateway_stats` on the control plane, through its beacons: a host writes and reads
//! through a gateway process, the API's answer counts exactly those ops; the gateway is
//! killed and started again (a new process counting from 0), the host does more I/O, and the
//! answer is the sum, never lower. No Ceph: the control plane keeps its state in memory and
//! the gateway serves a memory namespace from its file under the UUID the control plane gave
//! the namespace (so the control plane takes its counters as that namespace's).

mod common;

use std::time::Duration;

use common::gateway_process::{listener_toml, GatewayProcess};
use common::host::{connect_within, Attach, HostQueues};
use common::{free_port, pattern, poll_until, scratch_dir, unique_tag};
use control_plane::ana::Timing;
use control_plane::ceph_proto as pb;
use control_plane::ceph_proto::gateway_client::GatewayClient;
use control_plane::proto;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::server::Options;
use control_plane::store::Store;
use control_plane::test_support::{self, plain_channel};
use tonic::transport::Channel;

const SUBNQN: &str = "nqn.2016-06.io.test:io-stats";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000a5";
const BLOCK: u32 = 512;

/// gw1 of the group at `cp`, owning ANA group 1, serving a memory namespace 1 of SUBNQN in
/// group 1 under `uuid`.
fn gateway_toml(cp: &str, port: u16, uuid: &str) -> String {
    format!(
        r#"
[gateway]
name = "gw1"
worker_threads = 1
[group]
control_plane = ["{cp}"]
ana_group = 1
beacon_interval_ms = 200
{listener}
[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "4MiB"
ana_group = 1
uuid = "{uuid}"
"#,
        listener = listener_toml(port)
    )
}

/// Connected, and namespace 1 answers I/O (its group optimized here).
async fn connected(port: u16) -> HostQueues {
    let q = connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(30)).await;
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        async || {
            q.io.read(1, 0, 1, BLOCK)
                .await
                .map(|_| ())
                .map_err(|e| format!("namespace 1 does not answer reads: {e}"))
        },
    )
    .await;
    q
}

async fn stats(gw: &mut GatewayClient<Channel>) -> pb::NamespaceIoStatsInfo {
    gw.namespace_get_io_stats(pb::NamespaceGetIoStatsReq {
        subsystem_nqn: SUBNQN.into(),
        nsid: 1,
        ..Default::default()
    })
    .await
    .expect("namespace_get_io_stats")
    .into_inner()
}

/// Waits until the answer counts `reads` reads and `writes` writes (what the beacons carry
/// arrives within a beacon interval), and returns it.
async fn stats_reaching(
    gw: &GatewayClient<Channel>,
    reads: u64,
    writes: u64,
) -> pb::NamespaceIoStatsInfo {
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let s = stats(&mut gw.clone()).await;
            if s.status == 0 && s.num_read_ops >= reads && s.num_write_ops >= writes {
                Ok(s)
            } else {
                Err(format!(
                    "waiting for {reads} reads and {writes} writes: {s:?}"
                ))
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_io_is_counted_across_its_restart() {
    let name = format!("io-stats-{}", unique_tag());
    let dir = scratch_dir(&name);
    let backend = test_support::memory_backend_with_images(["rbd/img1".to_string()]);
    let options = Options {
        timing: Timing {
            grace_ms: 2_000,
            failback_delay_ms: 200,
        },
        lease: Duration::from_secs(3),
        tick: Duration::from_millis(50),
    };
    let cp = test_support::start_replica(Store::new(backend), "io-stats", options).await;
    let addr = test_support::serve_plain(cp.clone()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(5)).await;
    let mut gw = GatewayClient::new(plain_channel(&addr).await);

    // Group 1 exists once gw1 has beaconed: an earlier process of gw1's, as after a restart.
    GatewayControlClient::new(plain_channel(&addr).await)
        .send_group_beacon(proto::GroupBeacon {
            beacon: Some(proto::Beacon {
                gateway: "gw1".into(),
                ana_group: 1,
                incarnation: 1,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("beacon");
    let r = gw
        .create_subsystem(pb::CreateSubsystemReq {
            subsystem_nqn: SUBNQN.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let r = gw
        .add_host(pb::AddHostReq {
            subsystem_nqn: SUBNQN.into(),
            host_nqn: "*".into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let r = gw
        .namespace_add(pb::NamespaceAddReq {
            subsystem_nqn: SUBNQN.into(),
            rbd_pool_name: "rbd".into(),
            rbd_image_name: "img1".into(),
            nsid: Some(1),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner();
    assert_eq!(r.status, 0, "{r:?}");
    let uuid = gw
        .list_namespaces(pb::ListNamespacesReq {
            subsystem: SUBNQN.into(),
            ..Default::default()
        })
        .await
        .expect("rpc")
        .into_inner()
        .namespaces[0]
        .uuid
        .clone();

    let port = free_port();
    let config = gateway_toml(&addr, port, &uuid);
    let mut gw1 = GatewayProcess::spawn(&dir, "gw1", port, &config);
    eprintln!("gateway log: {}", gw1.log.display());
    let q = connected(port).await;
    // The reads that waited for the namespace are counted too: start from what they were.
    let before = stats_reaching(&gw, 1, 0).await;
    for i in 0..8u64 {
        q.io.write(1, i * 8, pattern(4096, i as u8), BLOCK)
            .await
            .expect("write");
    }
    for i in 0..16u64 {
        q.io.read(1, i * 8, 8, BLOCK).await.expect("read");
    }
    let reads = before.num_read_ops + 16;
    let s = stats_reaching(&gw, reads, 8).await;
    assert_eq!(
        (s.num_read_ops, s.num_write_ops, s.bytes_written),
        (reads, 8, 8 * 4096),
        "{s:?}"
    );
    assert_eq!(s.bytes_read, before.bytes_read + 16 * 4096);
    assert!(
        s.write_latency_ticks > 0
            && s.max_write_latency_ticks >= s.min_write_latency_ticks
            && s.min_write_latency_ticks > 0,
        "{s:?}"
    );
    let g = gw
        .get_gateway_stats(pb::GetGatewayStatsReq {})
        .await
        .expect("get_gateway_stats")
        .into_inner();
    let p = g
        .poll_groups
        .iter()
        .find(|p| p.name == "gw1")
        .expect("gw1's poll group");
    assert!(
        p.admin_qpairs >= 1 && p.io_qpairs >= 1 && p.completed_nvme_io >= reads + 8,
        "{g:?}"
    );
    // The host's controller, as gw1's last beacon listed it.
    assert_eq!(p.current_admin_qpairs, 1, "{g:?}");
    drop(q);

    // The gateway dies and starts again: its new process counts from 0; the answer keeps
    // the old process's counts and adds the new one's.
    gw1.signal("-KILL");
    let _ = gw1.child.wait();
    let mut gw1 = GatewayProcess::spawn(&dir, "gw1-again", port, &config);
    let q = connected(port).await;
    for i in 0..4u64 {
        q.io.read(1, i * 8, 8, BLOCK).await.expect("read");
    }
    // The new process's reads: the one `connected` waited with, and these 4.
    let s = stats_reaching(&gw, reads + 5, 8).await;
    assert_eq!((s.num_read_ops, s.num_write_ops), (reads + 5, 8), "{s:?}");
    drop(q);
    gw1.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}
