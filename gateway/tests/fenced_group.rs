//! One ANA group of a running gateway fenced on a real Ceph cluster: the gateway's librados
//! clients are sharded per ANA group, so blocklisting the client of group 1 (as the control
//! plane's fence does, here by hand with `ceph osd blocklist add`) stops exactly group 1 on
//! that gateway. Its writes fail with a path-related status (ANA Inaccessible, DNR clear: the
//! Linux host retries them on another path), never a silent success or a media error; its ANA
//! log page reports group 1 inaccessible; nothing it refused lands in the image (checked with
//! `rbd export`); and namespace 2 (group 2) keeps working through the same gateway.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test fenced_group -- --ignored --nocapture
//! ```

mod common;

use std::time::{Duration, Instant};

use common::ceph::{
    ceph_conf, create_image_pair, image_spec, rbd, remove_from_blocklist, remove_image_retrying,
    run,
};
use common::gateway_process::{listener_toml, two_group_subsystem_toml, GatewayProcess};
use common::host::{ana_states, connect_within, Attach, HostQueues};
use common::{free_port, scratch_dir, unique_tag};
use nvmeof_gateway::host::HostError;
use nvmeof_gateway::spec::ana;

const SUBNQN: &str = "nqn.2016-06.io.test:fenced-group";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000fe";
const BLOCK: u32 = 512;

fn pattern(seed: u8) -> Vec<u8> {
    common::pattern(BLOCK as usize * 8, seed)
}

/// The addresses the gateway logged for its connection(s) of `group`.
fn group_addrs_from_log(log: &str, group: u32) -> Vec<String> {
    log.lines()
        .map(|l| {
            // Strip ANSI colours.
            let mut out = String::new();
            let mut skip = false;
            for c in l.chars() {
                match (skip, c) {
                    (_, '\u{1b}') => skip = true,
                    (true, 'm') => skip = false,
                    (true, _) => {}
                    (false, c) => out.push(c),
                }
            }
            out
        })
        .filter(|l| l.contains("connected to the Ceph cluster"))
        .filter(|l| l.contains(&format!("group={group} ")))
        .filter_map(|l| {
            let rest = &l[l.find("addrs=")? + 6..];
            Some(rest.split_whitespace().next()?.to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn fencing_one_ana_group_stops_only_that_group_on_the_gateway() {
    let conf = ceph_conf();
    let tag = unique_tag();
    let images = create_image_pair(&format!("fenced-{tag}"), "16M");
    let dir = scratch_dir(&format!("fenced-group-{tag}"));
    let port = free_port();
    // A gateway of its own (no group, no control plane): the test fences by hand.
    let config = format!(
        "[gateway]\nworker_threads = 1\n{listener}{subsystem}\n[ceph]\nconf = \"{conf}\"\n",
        listener = listener_toml(port),
        subsystem = two_group_subsystem_toml(SUBNQN, &images),
    );
    let gw = GatewayProcess::spawn(&dir, "gw", port, &config);
    eprintln!("gateway log: {}", gw.log.display());
    let mut attach = Attach::new(HOSTNQN, SUBNQN);
    attach.command_timeout = Duration::from_secs(30);
    let HostQueues { admin, io } = connect_within(port, &attach, Duration::from_secs(30)).await;
    io.write(1, 0, pattern(1), BLOCK).await.expect("write ns 1");
    io.write(2, 0, pattern(2), BLOCK).await.expect("write ns 2");

    // Each group has its own client.
    let text = gw.log_text();
    let (g1, g2) = (
        group_addrs_from_log(&text, 1),
        group_addrs_from_log(&text, 2),
    );
    assert_eq!(g1.len(), 1, "group 1 clients {g1:?}\n{text}");
    assert_eq!(g2.len(), 1, "group 2 clients {g2:?}");
    assert_ne!(g1, g2, "both groups on one client");

    // Fence group 1 on this gateway.
    for a in rbd_backend::rados::split_addrs(&g1[0]) {
        run("ceph", &["osd", "blocklist", "add", &a, "600"]);
    }
    let fenced_at = Instant::now();

    // Its writes fail with a path status (retried elsewhere by a multipath host) ...
    let mut expected_1 = pattern(1);
    let err = loop {
        match io.write(1, 0, pattern(3), BLOCK).await {
            Err(e) => break e,
            Ok(()) => {
                // An OSD that has not seen the new osdmap yet may take one more.
                expected_1 = pattern(3);
                assert!(
                    fenced_at.elapsed() < Duration::from_secs(20),
                    "writes through the fenced group keep succeeding"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    eprintln!("write to the fenced group: {err}");
    match &err {
        HostError::Nvme(c) => {
            assert_eq!((c.sct(), c.sc()), (0x3, 0x02), "ANA Inaccessible: {err}");
            assert!(!c.dnr(), "DNR set: the host would not retry elsewhere");
        }
        other => panic!("expected an NVMe status, got {other}"),
    }
    // ... every later one too, reads as well, and the group is reported inaccessible here.
    for _ in 0..5 {
        assert!(io.write(1, 8, pattern(4), BLOCK).await.is_err());
    }
    assert!(io.read(1, 0, 8, BLOCK).await.is_err());
    let states = ana_states(&admin).await;
    assert_eq!(states.get(&1), Some(&ana::INACCESSIBLE), "{states:?}");
    assert_eq!(states.get(&2), Some(&ana::OPTIMIZED), "{states:?}");

    // Group 2 on the same gateway is untouched.
    io.write(2, 8, pattern(5), BLOCK)
        .await
        .expect("write ns 2 after group 1 was fenced");
    assert_eq!(
        io.read(2, 0, 8, BLOCK).await.expect("read ns 2"),
        pattern(2)
    );
    assert_eq!(
        io.read(2, 8, 8, BLOCK).await.expect("read ns 2"),
        pattern(5)
    );

    // What the fenced gateway refused never reached the image.
    drop(io);
    drop(admin);
    let mut gw = gw;
    let _ = gw.terminate();
    drop(gw);
    let exported = rbd(&["export", "--no-progress", &image_spec(&images[0]), "-"]);
    assert_eq!(&exported[..pattern(0).len()], expected_1.as_slice());
    assert!(
        exported[pattern(0).len()..2 * pattern(0).len()]
            .iter()
            .all(|b| *b == 0),
        "a refused write landed"
    );

    for a in rbd_backend::rados::split_addrs(&g1[0]) {
        remove_from_blocklist(&a);
    }
    for i in &images {
        remove_image_retrying(i, Duration::from_secs(60)).await;
    }
    let _ = std::fs::remove_dir_all(dir);
}
