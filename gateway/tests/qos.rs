//! Per-namespace QoS over NVMe/TCP (in-process gateway, loopback): a limited namespace runs at
//! its limit while another namespace on the same I/O queue of the same connection keeps its
//! own rate (the wait lives with the throttled command, not with the queue); the limit
//! changes and clears live; the metrics show the throttled commands and their wait.
//!
//! `QOS_ACCURACY=1 cargo test --release -p nvmeof-gateway --test qos -- --ignored --nocapture`
//! prints the accuracy of IOPS limits from 1K to 100K (docs/performance.md).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::host::{connect_within, Attach};
use nvmeof_gateway::core::qos::QosLimits;
use nvmeof_gateway::core::{Namespace, Target};
use rbd_backend::MemoryDevice;

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:qos-test";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5e5e5e5e-0000-0000-0000-000000000025";

/// The subsystem of `common::target_with_device` with a second namespace (NSID 2).
fn two_namespaces() -> Arc<Target> {
    let target = common::target_with_device(SUBNQN, Arc::new(MemoryDevice::new("a", 64 << 20)));
    let sub = target.subsystem(SUBNQN).expect("subsystem");
    sub.add_namespace(Arc::new(Namespace {
        nsid: 2,
        device: Arc::new(MemoryDevice::new("b", 64 << 20)),
        lba_shift: 9,
        nguid: [5; 16],
        uuid: [6; 16],
        ana_group: 1,
        read_only: false,
        qos: Default::default(),
        frozen_size: Default::default(),
    }));
    target
}

fn set_limits(target: &Target, nsid: u32, limits: QosLimits) {
    let ns = target
        .subsystem(SUBNQN)
        .and_then(|s| s.namespace(nsid))
        .expect("namespace");
    ns.qos.set_limits(limits);
}

/// Keeps `per_namespace` 4 KiB reads in flight on each of `nsids` over the one I/O queue for
/// `run`; returns the reads completed per namespace.
async fn read_load(
    io: Arc<nvmeof_gateway::host::HostConnection>,
    nsids: &[u32],
    per_namespace: usize,
    run: Duration,
) -> Vec<u64> {
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Vec<Arc<AtomicU64>> = nsids.iter().map(|_| Arc::default()).collect();
    let mut tasks = Vec::new();
    for (i, &nsid) in nsids.iter().enumerate() {
        for w in 0..per_namespace {
            let (io, stop, count) = (io.clone(), stop.clone(), counts[i].clone());
            tasks.push(tokio::spawn(async move {
                let mut lba = (w as u64) * 8;
                while !stop.load(Ordering::Relaxed) {
                    io.read(nsid, lba % 100_000, 8, 512).await.expect("read");
                    count.fetch_add(1, Ordering::Relaxed);
                    lba += 4096;
                }
            }));
        }
    }
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    let counts: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    for t in tasks {
        t.await.expect("load task");
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_namespace_keeps_its_rate_and_does_not_slow_its_neighbour() {
    let target = two_namespaces();
    let gw = common::serve_target(target.clone()).await;
    let q = connect_within(
        gw.addr.port(),
        &Attach::new(HOSTNQN, SUBNQN),
        Duration::from_secs(10),
    )
    .await;
    let io = Arc::new(q.io);
    let run = Duration::from_secs(2);

    let limit = 300;
    set_limits(
        &target,
        1,
        QosLimits {
            rw_ios_per_second: limit,
            ..QosLimits::UNLIMITED
        },
    );
    let counts = read_load(io.clone(), &[1, 2], 8, run).await;
    let (limited, neighbour) = (counts[0] as f64 / 2.0, counts[1] as f64 / 2.0);
    println!("limited to {limit} IOPS: {limited:.0} IOPS; its neighbour {neighbour:.0} IOPS");
    assert!(
        (limited - limit as f64).abs() <= 0.1 * limit as f64,
        "limited namespace at {limited:.0} IOPS, limit {limit}"
    );
    // If the wait held the queue, the neighbour would be dragged down to the limit too.
    assert!(
        neighbour >= 4.0 * limit as f64,
        "the unlimited namespace on the same queue ran at {neighbour:.0} IOPS"
    );

    let metrics = nvmeof_gateway::metrics::render(&target, "gw");
    let throttled = metrics
        .lines()
        .find(|l| {
            l.starts_with("nvmeof_namespace_throttled_commands_total") && l.contains("nsid=\"1\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<u64>().ok())
        .expect("throttled commands of nsid 1");
    assert!(throttled > limit, "{throttled} throttled commands");
    assert!(metrics.contains(
        "nvmeof_namespace_throttled_commands_total{subsystem=\"nqn.2016-06.io.ceph-nvmeof-rs:qos-test\",nsid=\"2\",device=\"b\"} 0"
    ));
    assert!(metrics.contains("limit=\"rw_ios_per_second\"} 300"));

    // Bandwidth: 1 MB/s of 4 KiB reads is 256 IOPS.
    set_limits(
        &target,
        1,
        QosLimits {
            r_megabytes_per_second: 1,
            ..QosLimits::UNLIMITED
        },
    );
    let counts = read_load(io.clone(), &[1], 8, run).await;
    let mib_per_s = counts[0] as f64 * 4096.0 / 2.0 / 1048576.0;
    assert!(
        (mib_per_s - 1.0).abs() <= 0.1,
        "limited to 1 MB/s: {mib_per_s:.3} MiB/s"
    );

    // Cleared: back to the neighbour's pace.
    set_limits(&target, 1, QosLimits::UNLIMITED);
    let counts = read_load(io.clone(), &[1], 8, run).await;
    assert!(
        counts[0] as f64 / 2.0 >= 4.0 * limit as f64,
        "cleared, yet {} IOPS",
        counts[0] / 2
    );
}

/// Accuracy of IOPS limits at QD32 (one queue, 4 KiB reads), against the unthrottled rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: QOS_ACCURACY=1, --release, -- --ignored --nocapture"]
async fn iops_limit_accuracy() {
    if std::env::var_os("QOS_ACCURACY").is_none() {
        return;
    }
    let target = two_namespaces();
    let gw = common::serve_target(target.clone()).await;
    let mut attach = Attach::new(HOSTNQN, SUBNQN);
    attach.io_sqsize = 63;
    let q = connect_within(gw.addr.port(), &attach, Duration::from_secs(10)).await;
    let io = Arc::new(q.io);
    let run = Duration::from_secs(3);
    let t0 = Instant::now();
    let free = read_load(io.clone(), &[1], 32, run).await[0] as f64 / run.as_secs_f64();
    println!("unthrottled: {free:.0} IOPS");
    for limit in [1_000u64, 10_000, 50_000, 100_000] {
        set_limits(
            &target,
            1,
            QosLimits {
                rw_ios_per_second: limit,
                ..QosLimits::UNLIMITED
            },
        );
        let got = read_load(io.clone(), &[1], 32, run).await[0] as f64 / run.as_secs_f64();
        println!(
            "limit {limit:>6} IOPS: measured {got:>8.0} IOPS ({:+.2}%)",
            (got - limit as f64) * 100.0 / limit as f64
        );
    }
    println!("({:.0} s)", t0.elapsed().as_secs_f64());
}
