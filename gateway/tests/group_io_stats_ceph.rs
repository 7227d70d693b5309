//! I/O statistics through a real failover and failback on a Ceph cluster: two gateway
//! processes serve an RBD namespace the control plane (state in RADOS) pushes them; a host
//! writes and reads through gw1, gw1 is killed (-9) and the namespace's group fails over to
//! gw2, the host writes through gw2, gw1 starts again and the group fails back (a new gw1
//! process counting from 0), the host writes through gw1 again. At each step ceph-nvmeof's
//! `namespace_get_io_stats` answers exactly the ops the host made, never fewer than before,
//! and `nvmeofctl namespace stats` shows each gateway's share.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo build -p control-plane --bin nvmeofctl
//! cargo test -p nvmeof-gateway --test group_io_stats_ceph -- --ignored --nocapture
//! ```

mod common;

use std::time::Duration;

use common::ceph::{ceph_conf, create_image_pair, pool, remove_image_retrying};
use common::control::{
    add_namespace_once_its_group_exists, admin_client, channel, nvmeofctl,
    start_rados_control_plane,
};
use common::gateway_process::{group_member_toml, GatewayProcess, GW1_CNTLIDS, GW2_CNTLIDS};
use common::host::{connect_within, wait_for_ana_states, wait_for_namespaces, Attach, HostQueues};
use common::{free_port, pattern, poll_until, scratch_dir, unique_tag};
use control_plane::ceph_proto as pb;
use control_plane::ceph_proto::gateway_client::GatewayClient;
use control_plane::proto;
use nvmeof_gateway::spec::ana;
use tonic::transport::Channel;

const SUBNQN: &str = "nqn.2016-06.io.test:io-stats-ceph";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000a6";
const BLOCK: u32 = 512;

/// A gateway of the group with no subsystem in its file: it serves what the control plane
/// pushes.
fn spawn(dir: &std::path::Path, name: &str, group: u32, cp: &str) -> GatewayProcess {
    let port = free_port();
    let cntlids = if group == 1 { GW1_CNTLIDS } else { GW2_CNTLIDS };
    let config = group_member_toml(name, Some(cntlids), cp, group, port);
    GatewayProcess::spawn(dir, &format!("{name}-{}", unique_tag()), port, &config)
}

/// Connected, with namespace 1 attached (pushed by the control plane).
async fn connect(port: u16) -> HostQueues {
    let q = connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(30)).await;
    wait_for_namespaces(&q.admin, &[1]).await;
    q
}

/// Waits until the answer counts `reads` reads and `writes` writes, then checks it counts
/// exactly that many (no op counted twice, none from elsewhere).
async fn stats_are(gw: &GatewayClient<Channel>, reads: u64, writes: u64) {
    let s = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            let s = gw
                .clone()
                .namespace_get_io_stats(pb::NamespaceGetIoStatsReq {
                    subsystem_nqn: SUBNQN.into(),
                    nsid: 1,
                    ..Default::default()
                })
                .await
                .expect("namespace_get_io_stats")
                .into_inner();
            if s.status == 0 && s.num_read_ops >= reads && s.num_write_ops >= writes {
                Ok(s)
            } else {
                Err(format!(
                    "waiting for {reads} reads and {writes} writes: {s:?}"
                ))
            }
        },
    )
    .await;
    assert_eq!(
        (s.num_read_ops, s.num_write_ops, s.bytes_written),
        (reads, writes, writes * 4096),
        "{s:?}"
    );
    eprintln!(
        "stats: {reads} reads, {writes} writes, mean write latency {} us",
        s.write_latency_ticks / writes.max(1) / 1000
    );
}

async fn write_n(q: &HostQueues, n: u64, seed: u8) {
    for i in 0..n {
        q.io.write(1, i * 8, pattern(4096, seed.wrapping_add(i as u8)), BLOCK)
            .await
            .expect("write");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn io_stats_survive_a_failover_and_a_restart() {
    ceph_conf();
    let name = format!("io-stats-{}", unique_tag());
    let images = create_image_pair(&name, "64M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane(&name, 500).await;
    let cp_addr = control.addr.clone();
    let gw1 = spawn(&dir, "gw1", 1, &cp_addr);
    let gw2 = spawn(&dir, "gw2", 2, &cp_addr);
    eprintln!("gateway logs: {} {}", gw1.log.display(), gw2.log.display());
    let mut admin = admin_client(&cp_addr).await;
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
    // Group 2 must exist too before gw1 dies, or there is nowhere to fail over to.
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            let groups = admin
                .ana_show(proto::Empty {})
                .await
                .expect("ana show")
                .into_inner()
                .groups;
            if groups.iter().any(|g| g.ana_group == 2) {
                Ok(())
            } else {
                Err(format!("no group 2 yet: {groups:?}"))
            }
        },
    )
    .await;
    let api = GatewayClient::new(channel(&cp_addr).await);

    let h1 = connect(gw1.port).await;
    let h2 = connect(gw2.port).await;
    wait_for_ana_states(&h1.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
    write_n(&h1, 10, 1).await;
    for i in 0..5u64 {
        h1.io.read(1, i * 8, 8, BLOCK).await.expect("read");
    }
    stats_are(&api, 5, 10).await;

    // kill -9 gw1: group 1 fails over to gw2, which counts from 0; the total keeps gw1's.
    gw1.signal("-KILL");
    drop(h1);
    wait_for_ana_states(&h2.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
    write_n(&h2, 3, 20).await;
    stats_are(&api, 5, 13).await;

    // gw1 starts again (a new process) and gets its group back (failback): its new counts
    // add to the old ones.
    drop(gw1);
    let gw1 = spawn(&dir, "gw1", 1, &cp_addr);
    let h1 = connect(gw1.port).await;
    wait_for_ana_states(&h1.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
    wait_for_ana_states(
        &h2.admin,
        &[(1, ana::INACCESSIBLE)],
        Duration::from_secs(10),
    )
    .await;
    write_n(&h1, 2, 40).await;
    stats_are(&api, 5, 15).await;

    // Each gateway's share: gw1 5 reads and 10 + 2 writes over its two processes, gw2 3
    // writes; then the total.
    let (code, table, err) = nvmeofctl(
        &cp_addr,
        &["namespace", "stats", "-n", SUBNQN, "--nsid", "1"],
    );
    assert_eq!(code, 0, "{err}");
    eprintln!("{table}");
    let row = |first: &str| -> Vec<String> {
        table
            .lines()
            .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>())
            .find(|cells| cells.first().map(String::as_str) == Some(first))
            .unwrap_or_else(|| panic!("no {first} row: {table}"))
    };
    // GATEWAY READS READ-BYTES WRITES WRITE-BYTES
    assert_eq!(row("gw1")[1..5], ["5", "20480", "12", "49152"], "{table}");
    assert_eq!(row("gw2")[1..5], ["0", "0", "3", "12288"], "{table}");
    assert_eq!(
        row("(total)")[1..5],
        ["5", "20480", "15", "61440"],
        "{table}"
    );

    drop((h1, h2, gw1, gw2));
    for image in &images {
        remove_image_retrying(image, Duration::from_secs(60)).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}
