//! The test gateways' files: a gateway process dropped by a passing test takes its
//! configuration, its log and their emptied directory with it, so test runs leave nothing in
//! `$TMPDIR`; one dropped while its test fails leaves them for the reader of the failure.

mod common;

use common::gateway_process::GatewayProcess;
use common::{free_port, memory_gateway_toml, scratch_dir};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:scratch";

fn spawn_in(dir: &std::path::Path) -> GatewayProcess {
    let port = free_port();
    GatewayProcess::spawn(
        dir,
        "gateway",
        port,
        &memory_gateway_toml(port, SUBNQN, "1MiB"),
    )
}

#[tokio::test]
async fn a_passing_test_leaves_no_gateway_files() {
    let dir = scratch_dir(&format!("nvmeof-scratch-pass-{}", std::process::id()));
    let gateway = spawn_in(&dir);
    gateway.wait_for_listener().await;
    assert!(dir.join("gateway.toml").exists() && gateway.log.exists());
    drop(gateway);
    assert!(!dir.exists(), "{} is still there", dir.display());
    // A gateway started again in the same directory makes it anew.
    let again = spawn_in(&dir);
    again.wait_for_listener().await;
    assert!(dir.join("gateway.toml").exists());
}

#[tokio::test]
async fn a_failing_test_keeps_its_gateway_files() {
    let dir = scratch_dir(&format!("nvmeof-scratch-fail-{}", std::process::id()));
    let gateway = spawn_in(&dir);
    gateway.wait_for_listener().await;
    // Dropped while a panic unwinds, as a failing assertion would drop it.
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _gateway = gateway;
        panic!("a failing test");
    }));
    assert!(unwound.is_err());
    assert!(dir.join("gateway.toml").exists() && dir.join("gateway.log").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
