//! Hosts writing at full queue depth into a cluster that does not answer (the micro
//! cluster's only OSD stopped with SIGSTOP): the gateway holds at most its data budget
//! (`[gateway] tcp_data_budget`) plus one command per queue of buffers, the other commands
//! wait without a buffer, and when the OSD runs again every write completes and `rbd export`
//! shows all of them. Without the budget each queue would hold a buffer per command, and
//! librbd a copy of each write, for as long as the cluster stalls.
//!
//! Needs a cluster and stops its OSD, so it is `#[ignore]`d and also opt-in with
//! `MICRO_CEPH_FAULT_TESTS=1` (which `rbd-backend/tests/ceph-tests.sh` sets):
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! MICRO_CEPH_FAULT_TESTS=1 cargo test -p nvmeof-gateway --test osd_stall_budget -- --ignored --nocapture
//! ```

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::ceph::{
    ceph_conf, create_image, image_spec, pool, rbd, remove_image_retrying, signal_osd, ResumeOsd,
};
use common::gateway_process::{listener_toml, GatewayProcess};
use common::host::{connect_within, Attach, HostQueues};
use common::{free_port, pattern, poll_until, rss_kib, scrape, scratch_dir};
use nvmeof_gateway::host::cmd::{io, Sqe};
use nvmeof_gateway::host::Xfer;

const SUBNQN: &str = "nqn.2016-06.io.test:osd-stall";
const MIB: usize = 1 << 20;
const BLOCKS_PER_MIB: u32 = (MIB / 512) as u32;
const HOSTS: usize = 4;
/// 1 MiB writes each host has outstanding (a Linux host's queue holds 128).
const WRITES_PER_HOST: usize = 32;
const BUDGET_MIB: usize = 16;

fn metric(port: u16, series: &str) -> f64 {
    scrape(port, series).unwrap_or_else(|| panic!("{series} in the scrape"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn writes_into_a_stalled_cluster_hold_at_most_the_data_budget_and_all_land() {
    if std::env::var("MICRO_CEPH_FAULT_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set MICRO_CEPH_FAULT_TESTS=1 (stops the cluster's OSD)");
        return;
    }
    let image = format!("osd-stall-{}", std::process::id());
    let image_mib = HOSTS * WRITES_PER_HOST;
    create_image(&image, &format!("{image_mib}M"));
    let dir = scratch_dir(&format!("osd-stall-{}", std::process::id()));
    let port = free_port();
    let metrics_port = free_port();
    let config = format!(
        r#"[gateway]
tcp_data_budget = "{BUDGET_MIB}MiB"
metrics_listen = "127.0.0.1:{metrics_port}"
{listener}
[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
pool = "{pool}"
image = "{image}"

[ceph]
conf = "{conf}"
"#,
        listener = listener_toml(port),
        pool = pool(),
        conf = ceph_conf(),
    );
    let gw = GatewayProcess::spawn(&dir, "gw", port, &config);
    eprintln!("gateway log: {}", gw.log.display());
    gw.wait_for_metrics(metrics_port).await;
    gw.wait_for_listener().await;
    let pid = gw.child.id();

    let mut hosts: Vec<HostQueues> = Vec::new();
    for h in 0..HOSTS {
        let mut attach = Attach::new(
            &format!("nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000005a1{h:02}"),
            SUBNQN,
        );
        attach.io_sqsize = 127;
        attach.command_timeout = Duration::from_secs(120);
        let host = connect_within(port, &attach, Duration::from_secs(30)).await;
        // One write first, so the image's exclusive lock is this gateway's before the stall.
        host.io
            .write(1, 0, pattern(4096, 0), 512)
            .await
            .expect("a first write");
        hosts.push(host);
    }
    let rss_before = rss_kib(pid);

    let resume = ResumeOsd;
    signal_osd("STOP");
    let data: Vec<Bytes> = (0..image_mib)
        .map(|slot| Bytes::from(pattern(MIB, slot as u8 ^ 0x5a)))
        .collect();
    let mut writes = Vec::new();
    for (h, host) in hosts.iter().enumerate() {
        for i in 0..WRITES_PER_HOST {
            let slot = h * WRITES_PER_HOST + i;
            let sqe = Sqe::rw(io::WRITE, 1, (slot * MIB / 512) as u64, BLOCKS_PER_MIB);
            let xfer = Xfer::Write(data[slot].clone());
            writes.push(host.io.start(sqe, xfer).await.expect("start a write"));
        }
    }
    // The budget is spent and the rest wait: every write is either holding a buffer
    // (admitted, at most the budget plus one per queue) or waiting without one.
    let waiting = poll_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        async || match metric(metrics_port, "nvmeof_tcp_commands_waiting_for_buffers") {
            w if w as usize >= HOSTS * WRITES_PER_HOST - BUDGET_MIB - HOSTS => Ok(w),
            w => Err(format!("{w} commands waiting for the budget")),
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        gw.log_text().contains("NVMe/TCP data budget spent"),
        "the admin is not told that commands wait for the budget"
    );
    let held = metric(metrics_port, "nvmeof_tcp_data_buffer_bytes") as usize;
    let grown_mib = rss_kib(pid).saturating_sub(rss_before) / 1024;
    eprintln!(
        "OSD stopped: {waiting} writes waiting, {} MiB of buffers held, the gateway grew by {grown_mib} MiB",
        held / MIB
    );
    assert!(
        held <= (BUDGET_MIB + HOSTS) * MIB + 256 * 1024,
        "{held} bytes of buffers held with a {BUDGET_MIB} MiB budget and {HOSTS} queues"
    );
    // Our buffers, librbd's copy of each write it was given, and what else the stall keeps;
    // without the budget 128 MiB of buffers and as much again in librbd.
    assert!(
        grown_mib < 3 * (BUDGET_MIB + HOSTS) as u64,
        "the gateway grew by {grown_mib} MiB while the OSD was stopped"
    );

    drop(resume);
    for w in writes {
        let r = w.wait().await.expect("a write the stall held");
        assert!(r.cqe.is_success(), "write status {:#x}", r.cqe.status());
    }
    assert_eq!(
        metric(metrics_port, "nvmeof_tcp_commands_waiting_for_buffers"),
        0.0
    );
    assert!(
        metric(metrics_port, "nvmeof_tcp_commands_waited_for_buffers_total") >= waiting,
        "every waiting command is counted"
    );
    for host in &hosts {
        host.io.flush(1).await.expect("flush");
    }
    drop(hosts);
    let mut gw = gw;
    let status = gw.terminate();
    assert!(status.success(), "the gateway exited with {status}");
    drop(gw);

    let exported = rbd(&["export", "--no-progress", &image_spec(&image), "-"]);
    assert_eq!(exported.len(), image_mib * MIB);
    for (slot, d) in data.iter().enumerate() {
        assert!(
            exported[slot * MIB..(slot + 1) * MIB] == d[..],
            "MiB {slot} of rbd export is not what was written there"
        );
    }
    remove_image_retrying(&image, Duration::from_secs(60)).await;
    let _ = std::fs::remove_dir_all(dir);
}
