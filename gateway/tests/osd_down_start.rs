//! Gateway start-up while the cluster's OSD is down: `rbd_open` blocks then (librbd waits for
//! the OSD holding the image header), and must not block the gateway. The `nvmeof-gateway`
//! process starts with a memory namespace and an RBD namespace while the micro cluster's only
//! OSD is stopped (SIGSTOP): it listens and serves the memory namespace within seconds, the
//! RBD one is reported and retried in the background, and it appears (Namespace Attribute
//! Changed, Changed Namespace List) once the OSD runs again.
//!
//! Needs a cluster and stops its OSD, so it is `#[ignore]`d and also opt-in with
//! `MICRO_CEPH_FAULT_TESTS=1` (which `rbd-backend/tests/ceph-tests.sh` sets):
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! MICRO_CEPH_FAULT_TESTS=1 cargo test -p nvmeof-gateway --test osd_down_start -- --ignored --nocapture
//! ```

mod common;

use std::time::{Duration, Instant};

use common::ceph::{ceph_conf, create_image, pool, remove_image_retrying, signal_osd, ResumeOsd};
use common::gateway_process::{listener_toml, GatewayProcess};
use common::host::{try_connect, Attach, HostQueues};
use common::{free_port, loopback, poll_until, scratch_dir};

const SUBNQN: &str = "nqn.2016-06.io.test:osd-down";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000d0";
const BLOCK: u32 = 512;

fn pattern(seed: u8) -> Vec<u8> {
    common::pattern(BLOCK as usize * 8, seed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn a_gateway_starts_and_serves_while_an_osd_is_down() {
    if std::env::var("MICRO_CEPH_FAULT_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set MICRO_CEPH_FAULT_TESTS=1 (stops the cluster's OSD)");
        return;
    }
    let conf = ceph_conf();
    let image = format!("osd-down-{}", std::process::id());
    create_image(&image, "16M");
    let dir = scratch_dir(&format!("osd-down-{}", std::process::id()));
    let port = free_port();
    let config = format!(
        r#"{listener}
[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "16MiB"

[[subsystem.namespace]]
nsid = 2
backend = "rbd"
pool = "{pool}"
image = "{image}"

[ceph]
conf = "{conf}"
"#,
        listener = listener_toml(port),
        pool = pool(),
    );

    let resume = ResumeOsd;
    signal_osd("STOP");
    let started = Instant::now();
    let gw = GatewayProcess::spawn(&dir, "gw", port, &config);
    eprintln!("gateway log: {}", gw.log.display());

    // It serves within seconds although rbd_open of namespace 2 cannot finish.
    let mut attach = Attach::new(HOSTNQN, SUBNQN);
    attach.command_timeout = Duration::from_secs(10);
    attach.keep_alive_ms = 60_000;
    let within = Duration::from_secs(20).saturating_sub(started.elapsed());
    let HostQueues { admin, io } = poll_until(within, Duration::from_millis(200), async || {
        try_connect(loopback(port), &attach)
            .await
            .map_err(|e| format!("the gateway did not serve within 20 s with the OSD down: {e}"))
    })
    .await;
    let serving_after = started.elapsed();
    eprintln!(
        "serving {} ms after start, the OSD down",
        serving_after.as_millis()
    );
    assert_eq!(
        admin.active_namespaces(0).await.expect("namespace list"),
        vec![1],
        "only the memory namespace while the OSD is down"
    );
    io.write(1, 0, pattern(1), BLOCK)
        .await
        .expect("write the memory namespace");
    assert_eq!(io.read(1, 0, 8, BLOCK).await.expect("read"), pattern(1));
    let text = gw.log_text();
    assert!(
        text.contains("subsystem[0].namespace[1]") && text.contains(&image),
        "the namespace left out is not reported with its field and image:\n{text}"
    );

    // The OSD back: namespace 2 is opened in the background and appears.
    drop(resume);
    let resumed = Instant::now();
    poll_until(
        Duration::from_secs(60),
        Duration::from_millis(250),
        async || {
            let active = admin.active_namespaces(0).await.expect("namespace list");
            if active == [1, 2] {
                Ok(())
            } else {
                Err(format!(
                    "namespace 2 never appeared after the OSD came back: {active:?}"
                ))
            }
        },
    )
    .await;
    eprintln!(
        "namespace 2 served {} ms after the OSD came back",
        resumed.elapsed().as_millis()
    );
    io.write(2, 0, pattern(2), BLOCK)
        .await
        .expect("write the RBD namespace");
    assert_eq!(io.read(2, 0, 8, BLOCK).await.expect("read"), pattern(2));

    drop(io);
    drop(admin);
    // SIGTERM: the gateway closes its images (no exclusive lock left behind) and exits 0.
    let mut gw = gw;
    let status = gw.terminate();
    assert!(status.success(), "the gateway exited with {status}");
    drop(gw);
    tokio::task::spawn_blocking(|| rbd_backend::rbd::wait_for_closes(Duration::from_secs(30)))
        .await
        .expect("join");
    // The killed gateway's exclusive lock may linger until its watch times out: retry.
    remove_image_retrying(&image, Duration::from_secs(60)).await;
    let _ = std::fs::remove_dir_all(dir);
}
