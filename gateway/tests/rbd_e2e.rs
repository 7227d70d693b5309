//! The gateway serving RBD images of a real Ceph cluster, driven over NVMe/TCP by the Rust
//! host (`nvmeof_gateway::host`); what it wrote is read back with `rbd export`.
//!
//! Needs a cluster, so every test is `#[ignore]`d in a plain `cargo test`; run them with
//! `bash rbd-backend/tests/ceph-tests.sh` (starts a micro cluster), or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test rbd_e2e -- --ignored
//! ```
//! Run that way, a test that finds no cluster fails with a message.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::ceph::{ceph_conf, create_image, image_spec, pool, rbd, remove_image};
use common::host::{try_connect, Attach, HostQueues};
use common::{pattern, poll_until, serve_target, TestGateway};
use nvmeof_gateway::config::{Config, SkippedNamespace};
use nvmeof_gateway::core::Target;
use nvmeof_gateway::host::HostConnection;
use nvmeof_gateway::metrics::render;

const SUBNQN: &str = "nqn.2016-06.io.test:rbd-e2e";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000e4";
const MIB: u64 = 1 << 20;

/// A fresh image, removed when dropped.
struct Image(String);

static NEXT: AtomicU64 = AtomicU64::new(0);

impl Image {
    fn create(size_mib: u64) -> Image {
        ceph_conf();
        let name = format!(
            "gw-e2e-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        create_image(&name, &format!("{size_mib}M"));
        Image(name)
    }

    fn spec(&self) -> String {
        image_spec(&self.0)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        remove_image(&self.0);
    }
}

/// A gateway in this process, with what it was built from (to retry skipped namespaces).
struct Gateway {
    served: TestGateway,
    config: Config,
    target: Arc<Target>,
    skipped: Vec<SkippedNamespace>,
}

/// A gateway with namespace 1 on `image` and namespace 2 on an image that does not exist.
async fn start(image: &str, block_size: u32) -> Gateway {
    start_with_missing(image, block_size, "no-such-image").await
}

async fn start_with_missing(image: &str, block_size: u32, missing: &str) -> Gateway {
    let config = Config::from_toml_str(&format!(
        r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "{SUBNQN}"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "rbd"
        pool = "{pool}"
        image = "{image}"
        block_size = {block_size}

        [[subsystem.namespace]]
        nsid = 2
        backend = "rbd"
        pool = "{pool}"
        image = "{missing}"

        [ceph]
        conf = "{conf}"
        "#,
        pool = pool(),
        conf = ceph_conf(),
    ))
    .expect("valid configuration");
    // Opening images blocks: do it off the runtime's threads.
    let (config, built) = tokio::task::spawn_blocking(move || {
        let built = config.build_target_report();
        (config, built)
    })
    .await
    .expect("join");
    let (target, skipped) = built.expect("target");
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert_eq!(skipped[0].field, "subsystem[0].namespace[1]");
    assert!(skipped[0].error.contains(missing), "{skipped:?}");
    Gateway {
        served: serve_target(target.clone()).await,
        config,
        target,
        skipped,
    }
}

impl Gateway {
    async fn stop(self) {
        let _ = self.served.shutdown.send(true);
        let _ = self.served.server.await;
        // closing images happens on background threads: wait so that `rbd export` sees an
        // image without our exclusive lock
        tokio::task::spawn_blocking(|| rbd_backend::rbd::wait_for_closes(Duration::from_secs(30)))
            .await
            .expect("join");
    }
}

async fn connect(addr: SocketAddr) -> (HostConnection, HostConnection) {
    let mut attach = Attach::new(HOSTNQN, SUBNQN);
    attach.keep_alive_ms = 60_000;
    attach.io_sqsize = 63;
    let HostQueues { admin, io } = try_connect(addr, &attach)
        .await
        .expect("connect to the gateway");
    (admin, io)
}

async fn io_and_export(block_size: u32) {
    let image = Image::create(64);
    let gw = start(&image.0, block_size).await;
    let (admin, q) = connect(gw.served.addr).await;
    assert_eq!(
        admin.active_namespaces(0).await.expect("ns list"),
        vec![1],
        "the namespace on a missing image is not served, the other one is"
    );
    let ns = admin.identify_namespace(1).await.expect("identify ns");
    assert_eq!(ns.block_size(), block_size);
    assert_eq!(ns.nsze() * u64::from(block_size), 64 * MIB);
    let bs = u64::from(block_size);

    // what the image should hold afterwards
    let mut expect = vec![0u8; (8 * MIB) as usize];
    let big = pattern((2 * MIB) as usize, 1);
    let at = 4 * MIB - MIB; // across the first object boundary
    const CHUNK: u64 = 128 * 1024; // within any MDTS
    for (i, piece) in big.chunks(CHUNK as usize).enumerate() {
        q.write(1, (at + i as u64 * CHUNK) / bs, piece.to_vec(), block_size)
            .await
            .expect("write");
    }
    expect[at as usize..(at + 2 * MIB) as usize].copy_from_slice(&big);
    let small = pattern(8192, 2);
    q.write(1, 0, small.clone(), block_size)
        .await
        .expect("write");
    expect[..8192].copy_from_slice(&small);
    // write zeroes and deallocate inside written data
    q.write_zeroes(1, (at + 65536) / bs, (8192 / bs) as u32)
        .await
        .expect("write zeroes");
    expect[(at + 65536) as usize..(at + 65536 + 8192) as usize].fill(0);
    q.dsm_deallocate(1, &[((at + 131072) / bs, (4096 / bs) as u32)])
        .await
        .expect("deallocate");
    expect[(at + 131072) as usize..(at + 131072 + 4096) as usize].fill(0);
    let back = q
        .read(1, (at + 65536) / bs, (131072 / bs) as u32, block_size)
        .await
        .expect("read");
    assert_eq!(
        back,
        expect[(at + 65536) as usize..(at + 65536 + 131072) as usize],
        "zeroed and deallocated blocks read back zero through the gateway"
    );
    // fused compare-and-write of one block (512: librbd's own; 4096: emulated)
    let old = expect[..block_size as usize].to_vec();
    let new = pattern(block_size as usize, 3);
    assert!(q
        .compare_and_write(1, 0, old.clone(), new.clone(), block_size)
        .await
        .expect("compare-and-write"));
    assert!(!q
        .compare_and_write(1, 0, old, pattern(block_size as usize, 4), block_size)
        .await
        .expect("compare-and-write (miscompare)"));
    expect[..block_size as usize].copy_from_slice(&new);
    q.flush(1).await.expect("flush");
    drop(q);
    drop(admin);
    gw.stop().await;

    let exported = rbd(&["export", "--no-progress", &image.spec(), "-"]);
    assert_eq!(exported.len() as u64, 64 * MIB);
    let first_diff = exported[..expect.len()]
        .iter()
        .zip(&expect)
        .position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "rbd export differs from what was written");
    assert!(
        exported[expect.len()..].iter().all(|&b| b == 0),
        "the rest of the image is untouched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Ceph: bash rbd-backend/tests/ceph-tests.sh"]
async fn rbd_namespace_512_data_matches_rbd_export() {
    io_and_export(512).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Ceph: bash rbd-backend/tests/ceph-tests.sh"]
async fn rbd_namespace_4k_data_matches_rbd_export() {
    io_and_export(4096).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Ceph: bash rbd-backend/tests/ceph-tests.sh"]
async fn rbd_resize_is_seen_by_a_connected_host() {
    let image = Image::create(32);
    let gw = start(&image.0, 512).await;
    let (admin, q) = connect(gw.served.addr).await;
    assert_eq!(
        admin.identify_namespace(1).await.expect("identify").nsze() * 512,
        32 * MIB
    );
    let spec = image.spec();
    tokio::task::spawn_blocking(move || rbd(&["resize", "--size", "48M", &spec]))
        .await
        .expect("join");
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        async || {
            let nsze = admin.identify_namespace(1).await.expect("identify").nsze();
            if nsze * 512 == 48 * MIB {
                Ok(())
            } else {
                Err(format!(
                    "the host still sees {nsze} blocks 20 s after rbd resize"
                ))
            }
        },
    )
    .await;
    // the new space is usable without reconnecting
    let data = pattern(4096, 9);
    q.write(1, 40 * MIB / 512, data.clone(), 512)
        .await
        .expect("write past the old end");
    assert_eq!(q.read(1, 40 * MIB / 512, 8, 512).await.expect("read"), data);
    drop(q);
    drop(admin);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Ceph: bash rbd-backend/tests/ceph-tests.sh"]
async fn a_skipped_namespace_is_served_once_its_image_exists() {
    let image = Image::create(16);
    let late = Image(format!("gw-late-{}", std::process::id()));
    let gw = start_with_missing(&image.0, 512, &late.0).await;
    let retry = gw
        .config
        .spawn_namespace_retry(&gw.target, &gw.skipped, Duration::from_millis(200))
        .expect("a retry thread for the skipped namespace");
    let (admin, q) = connect(gw.served.addr).await;
    assert_eq!(admin.active_namespaces(0).await.expect("ns list"), vec![1]);
    // reported as unavailable, with its image, until it is served
    let unavailable = format!(
        "nvmeof_namespace_unavailable{{subsystem=\"{SUBNQN}\",nsid=\"2\",device=\"{}\"}} 1",
        late.spec()
    );
    let served_info = format!(
        "nvmeof_namespace_info{{subsystem=\"{SUBNQN}\",nsid=\"2\",device=\"{}\",ana_group=\"1\"}} 1",
        late.spec()
    );
    let metrics = render(&gw.target, "");
    assert!(metrics.lines().any(|l| l == unavailable), "{metrics}");
    assert!(!metrics.contains(&served_info), "{metrics}");
    let spec = late.spec();
    tokio::task::spawn_blocking(move || rbd(&["create", "--size", "8M", &spec]))
        .await
        .expect("join");
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        async || {
            if admin.active_namespaces(0).await.expect("ns list") == [1, 2] {
                Ok(())
            } else {
                Err("namespace 2 not served 20 s after its image was created".to_string())
            }
        },
    )
    .await;
    assert_eq!(
        admin.identify_namespace(2).await.expect("identify").nsze() * 512,
        8 * MIB
    );
    let data = pattern(4096, 11);
    q.write(2, 8, data.clone(), 512).await.expect("write ns 2");
    assert_eq!(q.read(2, 8, 8, 512).await.expect("read ns 2"), data);
    let metrics = render(&gw.target, "");
    assert!(
        !metrics.contains("nvmeof_namespace_unavailable{"),
        "{metrics}"
    );
    assert!(metrics.lines().any(|l| l == served_info), "{metrics}");
    // the RBD device counted the host's I/O
    let ns2 = format!(
        "subsystem=\"{SUBNQN}\",nsid=\"2\",device=\"{}\"",
        late.spec()
    );
    for (series, value) in [
        (
            format!("nvmeof_namespace_ops_total{{{ns2},op=\"write\"}}"),
            "1",
        ),
        (
            format!("nvmeof_namespace_bytes_total{{{ns2},op=\"read\"}}"),
            "4096",
        ),
    ] {
        assert!(
            metrics.lines().any(|l| l == format!("{series} {value}")),
            "{series} {value} in\n{metrics}"
        );
    }
    tokio::task::spawn_blocking(move || retry.join())
        .await
        .expect("join")
        .expect("the retry thread ends once all are served");
    drop(q);
    drop(admin);
    gw.stop().await;
}
