//! The Ceph cluster of the tests: the one `scripts/micro-ceph.sh start` describes in the
//! environment (`CEPH_CONF`, `CEPH_KEYRING`, `MICRO_CEPH_POOL`, `MICRO_CEPH_DIR`), and the
//! `rbd`/`ceph` tools run against it.
//!
//! These tests are `#[ignore]`d in a plain `cargo test`; `rbd-backend/tests/ceph-tests.sh`
//! starts a micro cluster and runs them with `--ignored`. Run that way without a cluster, a
//! test fails with [`ceph_conf`]'s message rather than passing without having run.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use rbd_backend::rbd::CephSettings;

/// The cluster's ceph.conf; panics, saying how to start one, when there is none.
pub fn ceph_conf() -> String {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && std::path::Path::new(&conf).is_file(),
        "this test needs a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\"  (or run rbd-backend/tests/ceph-tests.sh)"
    );
    conf
}

/// The pool the test images go in.
pub fn pool() -> String {
    std::env::var("MICRO_CEPH_POOL").unwrap_or_else(|_| "rbd".into())
}

/// `pool/image`, as the `rbd` tool names an image.
pub fn image_spec(image: &str) -> String {
    format!("{}/{image}", pool())
}

/// How the test's own librados clients (a control plane's state, clean-up) reach the cluster:
/// one connection is enough for them.
pub fn ceph_settings() -> CephSettings {
    CephSettings {
        conf: Some(PathBuf::from(ceph_conf())),
        keyring: std::env::var("CEPH_KEYRING").ok().map(PathBuf::from),
        max_connections: 1,
        ..CephSettings::default()
    }
}

/// Runs `cmd` and returns its standard output; panics with its standard error if it fails.
pub fn run(cmd: &str, args: &[&str]) -> Vec<u8> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs the `rbd` tool (from the `ceph-common` package); panics if it fails.
pub fn rbd(args: &[&str]) -> Vec<u8> {
    run("rbd", args)
}

/// Creates `image` of `size` (as `rbd create --size` reads it, e.g. "16M") in the pool.
pub fn create_image(image: &str, size: &str) {
    rbd(&["create", "--size", size, &image_spec(image)]);
}

/// Creates `<prefix>-1` and `<prefix>-2` of `size` (a namespace for each of two ANA groups)
/// and returns their names.
pub fn create_image_pair(prefix: &str, size: &str) -> [String; 2] {
    let images = [format!("{prefix}-1"), format!("{prefix}-2")];
    for image in &images {
        create_image(image, size);
    }
    images
}

/// Removes `image`, once, whatever the outcome (clean-up after the checks).
pub fn remove_image(image: &str) {
    let _ = Command::new("rbd")
        .args(["rm", "--no-progress", &image_spec(image)])
        .output();
}

/// Removes `image`, retrying for up to `within`: a killed gateway's exclusive lock lingers
/// on it until the gateway's watch times out.
pub async fn remove_image_retrying(image: &str, within: Duration) {
    let spec = image_spec(image);
    let deadline = Instant::now() + within;
    while Command::new("rbd")
        .args(["rm", "--no-progress", &spec])
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Takes `addr` off the OSD blocklist, whatever the outcome (clean-up).
pub fn remove_from_blocklist(addr: &str) {
    let _ = Command::new("ceph")
        .args(["osd", "blocklist", "rm", addr])
        .output();
}
