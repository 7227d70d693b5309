//! The Ceph cluster of the tests: the one `scripts/micro-ceph.sh start` describes in the
//! environment (`CEPH_CONF`, `CEPH_KEYRING`, `MICRO_CEPH_POOL`, `MICRO_CEPH_DIR`), and the
//! `rbd`/`ceph` tools run against it.
//!
//! These tests are `#[ignore]`d in a plain `cargo test`; `rbd-backend/tests/ceph-tests.sh`
//! starts a micro cluster and runs them with `--ignored`. Run that way without a cluster, a
//! test fails with [`ceph_conf`]'s message rather than passing without having run.

use std::process::Command;
use std::time::{Duration, Instant};

pub use control_plane::test_support::{ceph_conf, ceph_pool as pool, ceph_settings};

/// `pool/image`, as the `rbd` tool names an image.
pub fn image_spec(image: &str) -> String {
    format!("{}/{image}", pool())
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

/// Sends `signal` to the micro cluster's OSD (PIDs from `$MICRO_CEPH_DIR/pids`): `STOP`
/// makes it alive but silent, as a hung OSD is; `CONT` resumes it.
pub fn signal_osd(signal: &str) {
    let dir = std::env::var("MICRO_CEPH_DIR")
        .expect("MICRO_CEPH_DIR (set by scripts/micro-ceph.sh env) names the cluster");
    let pids = std::fs::read_to_string(format!("{dir}/pids")).expect("read $MICRO_CEPH_DIR/pids");
    let pid = pids
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let pid = f.next()?;
            (f.next()? == "osd.0").then(|| pid.to_string())
        })
        .expect("osd.0 in pids");
    run("kill", &[&format!("-{signal}"), &pid]);
}

/// Resumes the OSD however the test ends.
pub struct ResumeOsd;

impl Drop for ResumeOsd {
    fn drop(&mut self) {
        signal_osd("CONT");
    }
}

/// The OSD blocklist, as `ceph osd blocklist ls` prints it.
pub fn osd_blocklist() -> String {
    String::from_utf8_lossy(&run("ceph", &["osd", "blocklist", "ls"])).into_owned()
}
