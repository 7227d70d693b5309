//! Failover after kill -9 of a gateway, on a real Ceph cluster: two `nvmeof-gateway`
//! processes, an in-process control plane (state in RADOS) with a beacon grace far longer than
//! the test allows, and the Rust NVMe/TCP host. The dead process's connections reset, its
//! presence stream with the control plane ends, and the leader fences its clients for group
//! 1 at once; group 1 then turns optimized on gw2 long before the grace could have run out.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! FAILOVER_RUNS=5 cargo test -p nvmeof-gateway --test failover_kill -- --ignored --nocapture
//! ```

mod common;

use std::time::{Duration, Instant};

use common::ceph::{
    ceph_conf, ceph_settings, create_image_pair, osd_blocklist, pool, remove_image,
};
use common::control::start_rados_control_plane_with_grace;
use common::gateway_process::{spawn_group_gateway, GW1_CNTLIDS, GW2_CNTLIDS};
use common::host::{connect_within, wait_for_ana_states, Attach, HostQueues};
use common::{scratch_dir, unique_tag};
use control_plane::ana::Availability;
use nvmeof_gateway::spec::ana;
use rbd_backend::rados::Client;

const SUBNQN: &str = "nqn.2016-06.io.test:failover-kill";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000f1";
const BLOCK: u32 = 512;
/// The beacon grace: missed beacons alone would take this long to start a failover.
const GRACE_MS: u64 = 10_000;
/// What a failover after kill -9 may take here (a loaded shared machine included).
const WITHIN: Duration = Duration::from_secs(4);

async fn connect(port: u16, within: Duration) -> HostQueues {
    connect_within(port, &Attach::new(HOSTNQN, SUBNQN), within).await
}

fn pattern(seed: u8) -> Vec<u8> {
    common::pattern(BLOCK as usize * 8, seed)
}

/// Whether every address of the client `addr` (`[v2:...,v1:...]`) is in the blocklist (which
/// lists them without the `v1:`/`v2:` prefix).
fn blocklisted(addr: &str, blocklist: &str) -> bool {
    let bare = |a: &str| {
        a.trim_start_matches("v1:")
            .trim_start_matches("v2:")
            .to_string()
    };
    rbd_backend::rados::split_addrs(addr).iter().all(|one| {
        blocklist
            .split_whitespace()
            .any(|token| bare(token) == bare(one))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn a_killed_gateway_is_fenced_at_once_and_its_group_moves_within_the_grace() {
    ceph_conf();
    let name = format!("failover-kill-{}", unique_tag());
    let images = create_image_pair(&name, "64M");
    let dir = scratch_dir(&name);
    let control = start_rados_control_plane_with_grace(&name, 500, GRACE_MS).await;
    let (cp, cp_addr, oid) = (control.cp, control.addr, control.state_oid);
    let gw2 = spawn_group_gateway(&dir, "gw2", 2, GW2_CNTLIDS, &cp_addr, SUBNQN, &images);
    let h2 = connect(gw2.port, Duration::from_secs(30)).await;
    eprintln!("gateway logs in {}", dir.display());
    let runs: usize = std::env::var("FAILOVER_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let mut pauses = Vec::new();
    let mut fenced_addrs = Vec::new();
    for round in 0..runs {
        let seed = round as u8 * 2;
        let gw1 = spawn_group_gateway(&dir, "gw1", 1, GW1_CNTLIDS, &cp_addr, SUBNQN, &images);
        let h1 = connect(gw1.port, Duration::from_secs(30)).await;
        wait_for_ana_states(
            &h1.admin,
            &[(1, ana::OPTIMIZED), (2, ana::INACCESSIBLE)],
            Duration::from_secs(30),
        )
        .await;
        wait_for_ana_states(
            &h2.admin,
            &[(1, ana::INACCESSIBLE), (2, ana::OPTIMIZED)],
            Duration::from_secs(10),
        )
        .await;
        h1.io
            .write(1, 0, pattern(seed + 1), BLOCK)
            .await
            .expect("write via gw1");
        let map = cp.state().map.expect("group map");
        let gw1_group1 = map.gateways["gw1"]
            .group_addrs
            .clone()
            .and_then(|mut g| g.remove(&1))
            .unwrap_or_default();
        assert!(!gw1_group1.is_empty(), "gw1 reported no client for group 1");
        let incarnation = map.gateways["gw1"].incarnation;

        // kill -9: a write through gw2 succeeds as soon as group 1 is optimized there (the
        // host retries every 20 ms).
        let killed = Instant::now();
        gw1.signal("-KILL");
        loop {
            match tokio::time::timeout(
                Duration::from_secs(2),
                h2.io.write(1, 0, pattern(seed + 2), BLOCK),
            )
            .await
            {
                Ok(Ok(())) => break,
                _ => {
                    assert!(
                        killed.elapsed() < Duration::from_secs(GRACE_MS / 1000 + 10),
                        "no failover"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        let pause = killed.elapsed();
        eprintln!(
            "round {round}: kill -9 of gw1 -> first write through gw2 {} ms (grace {GRACE_MS} ms)",
            pause.as_millis()
        );
        assert!(
            pause < WITHIN,
            "the failover took {pause:?}: not driven by the stream end (grace {GRACE_MS} ms)"
        );
        pauses.push(pause);
        // Fenced first: the dead process's group-1 clients are in the blocklist, and the map
        // says so for that process.
        let blocklist = osd_blocklist();
        for a in &gw1_group1 {
            assert!(
                blocklisted(a, &blocklist),
                "{a} not blocklisted:\n{blocklist}"
            );
        }
        let map = cp.state().map.expect("group map");
        assert_eq!(map.groups[&1].holder, "gw2");
        assert_eq!(map.gateways["gw1"].availability, Availability::Fenced);
        assert_eq!(map.gateways["gw1"].fenced_incarnation, Some(incarnation));
        assert_eq!(
            h2.io.read(1, 0, 8, BLOCK).await.expect("read via gw2"),
            pattern(seed + 2)
        );
        fenced_addrs.extend(gw1_group1);
        drop(h1);
        drop(gw1);
    }
    let mut ms: Vec<u128> = pauses.iter().map(|d| d.as_millis()).collect();
    ms.sort_unstable();
    eprintln!(
        "write pause (kill -9 of the owner -> first write through the survivor) over {} runs: median {} ms, max {} ms, all {:?}",
        ms.len(),
        ms[ms.len() / 2],
        ms[ms.len() - 1],
        ms
    );

    // Clean up: processes, blocklist entries (every gateway's, failbacks fence gw2's too),
    // images, state object.
    fenced_addrs.extend(
        cp.state()
            .map
            .map(|m| {
                m.gateways
                    .values()
                    .flat_map(|g| g.group_addrs.clone().unwrap_or_default().into_values())
                    .flatten()
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default(),
    );
    drop(h2);
    drop(gw2);
    let (s, p) = (ceph_settings(), pool());
    tokio::task::spawn_blocking(move || {
        if let Ok(c) = Client::connect(&s) {
            for a in &fenced_addrs {
                let _ = c.blocklist_rm(a);
            }
            if let Ok(pl) = c.pool(&p, None) {
                let _ = pl.remove(&oid);
            }
        }
    })
    .await
    .expect("cleanup");
    for i in &images {
        remove_image(i);
    }
    let _ = std::fs::remove_dir_all(dir);
}
