//! What a gateway process keeps after bursts of large I/O: an idle NVMe/TCP connection hands
//! back the data buffers of its last burst instead of sitting on them, so the memory of a
//! gateway with many hosts follows what they do at once, not the sum of their peaks.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::gateway_process::GatewayProcess;
use common::host::{connect_within, Attach, HostQueues};
use common::{pattern, poll_until, rss_kib, scrape, scratch_dir};
use nvmeof_gateway::host::cmd::{io, Sqe};
use nvmeof_gateway::host::Xfer;

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:buffers";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000000b0f0";
const MIB: usize = 1 << 20;
/// Commands in one burst: what a Linux host's 128-entry queue takes from fio at
/// iodepth=64, bs=1M (the namespace is 16 MiB, so they overlap 4 times).
const BURST: u64 = 64;
const BLOCKS_PER_MIB: u64 = (MIB / 512) as u64;

/// `BURST` 1 MiB writes at once, then `BURST` 1 MiB reads at once, all checked.
async fn burst(host: &HostQueues, seed: u8) {
    let data: Vec<Bytes> = (0..16)
        .map(|i| Bytes::from(pattern(MIB, seed ^ i)))
        .collect();
    let mut writes = Vec::new();
    for i in 0..BURST {
        let slot = (i % 16) as usize;
        let sqe = Sqe::rw(
            io::WRITE,
            1,
            slot as u64 * BLOCKS_PER_MIB,
            BLOCKS_PER_MIB as u32,
        );
        let xfer = Xfer::Write(data[slot].clone());
        writes.push(host.io.start(sqe, xfer).await.expect("start a write"));
    }
    for w in writes {
        assert!(w.wait().await.expect("write").cqe.is_success());
    }
    let mut reads = Vec::new();
    for i in 0..BURST {
        let slot = i % 16;
        let sqe = Sqe::rw(io::READ, 1, slot * BLOCKS_PER_MIB, BLOCKS_PER_MIB as u32);
        reads.push((
            slot,
            host.io
                .start(sqe, Xfer::Read(MIB as u32))
                .await
                .expect("start"),
        ));
    }
    for (slot, r) in reads {
        let r = r.wait().await.expect("read");
        assert!(r.cqe.is_success());
        assert!(
            r.data == data[slot as usize],
            "slot {slot} reads back what was written"
        );
    }
}

async fn kept_buffer_bytes(metrics_port: u16) -> f64 {
    scrape(metrics_port, "nvmeof_tcp_kept_buffer_bytes").expect("the gauge in the scrape")
}

#[tokio::test]
async fn idle_connections_do_not_keep_the_buffers_of_their_last_burst() {
    let dir = scratch_dir(&format!("nvmeof-buffers-{}", std::process::id()));
    let (gateway, port, metrics_port) =
        GatewayProcess::spawn_memory_with_metrics(&dir, SUBNQN, "worker_threads = 1\n").await;
    let pid = gateway.child.id();
    let mut attach = Attach::new(HOSTNQN, SUBNQN);
    attach.io_sqsize = 127;

    let mut hosts = Vec::new();
    let mut rss_after_first = 0;
    for h in 0..5u8 {
        let host = connect_within(port, &attach, Duration::from_secs(20)).await;
        burst(&host, h).await;
        if h == 0 {
            // The high-water mark: glibc may hand some of it back to the kernel once the
            // buffers are released, and the next burst takes it again.
            rss_after_first = rss_kib(pid);
        }
        hosts.push(host);
        // Each idle queue (an admin and an I/O queue per host) keeps at most 1 MiB, once it
        // has had no command for a second.
        let bound = (2 * hosts.len() * MIB) as f64;
        poll_until(
            Duration::from_secs(10),
            Duration::from_millis(50),
            async || match kept_buffer_bytes(metrics_port).await {
                kept if kept <= bound => Ok(()),
                kept => Err(format!("{kept} bytes kept by {} idle hosts", hosts.len())),
            },
        )
        .await;
    }
    // The later bursts reuse what the first one released. Before, every idle host kept its
    // burst's 64 MiB of data buffers (4 x 67 MiB here), and then still its receive buffer,
    // grown to hold a 1 MiB H2CData PDU (~1.25 MiB per host). One runtime worker: glibc
    // keeps freed memory in the arena of the thread that allocated it, so with a worker per
    // core a later burst on another worker could fill another arena.
    let grown_kib = rss_kib(pid).saturating_sub(rss_after_first);
    println!("the gateway grew by {grown_kib} KiB over four more hosts' bursts");
    assert!(
        grown_kib < 3 * 1024,
        "the gateway grew by {grown_kib} KiB over four more hosts' bursts"
    );
}

/// An idle queue costs the gateway little resident memory: its receive buffer is only
/// touched as far as PDUs fill it, and its free list keeps what its last small I/O used.
#[tokio::test]
async fn an_idle_connection_costs_kilobytes() {
    let dir = scratch_dir(&format!("nvmeof-idle-queues-{}", std::process::id()));
    let (gateway, port, _metrics_port) =
        GatewayProcess::spawn_memory_with_metrics(&dir, SUBNQN, "").await;
    let pid = gateway.child.id();
    let attach = Attach::new(HOSTNQN, SUBNQN);
    let data = pattern(4096, 9);
    let first = connect_within(port, &attach, Duration::from_secs(20)).await;
    first
        .io
        .write(1, 8, data.clone(), 512)
        .await
        .expect("write");
    let before = rss_kib(pid);

    const HOSTS: u64 = 64;
    let mut hosts = Vec::new();
    for _ in 0..HOSTS {
        let host = connect_within(port, &attach, Duration::from_secs(20)).await;
        host.io.write(1, 8, data.clone(), 512).await.expect("write");
        assert_eq!(host.io.read(1, 8, 8, 512).await.expect("read"), data);
        hosts.push(host);
    }
    let per_queue = rss_kib(pid).saturating_sub(before) / (2 * HOSTS);
    println!(
        "{HOSTS} hosts, {} queues: {per_queue} KiB RSS per queue",
        2 * HOSTS
    );
    assert!(per_queue < 128, "{per_queue} KiB per idle queue");
}
