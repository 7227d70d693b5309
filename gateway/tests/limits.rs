//! The daemon raises its soft open-file limit to the hard limit at start (see
//! `nvmeof_gateway::limits`): started with a soft limit of 256, the running process has
//! soft = hard, and says so in its log.

mod common;

use std::time::Duration;

use common::gateway_process::GatewayProcess;
use common::{free_port, memory_gateway_toml, scratch_dir};

const STARTING_SOFT_LIMIT: u64 = 256;

/// (soft, hard) "Max open files" of a process, from /proc/PID/limits.
fn open_file_limits(pid: u32) -> (String, String) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a 'Max open files' line");
    let fields: Vec<&str> = line["Max open files".len()..].split_whitespace().collect();
    (fields[0].to_string(), fields[1].to_string())
}

#[tokio::test]
async fn the_gateway_raises_its_soft_open_file_limit_to_the_hard_limit() {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    assert!(
        hard.is_none_or(|h| h > STARTING_SOFT_LIMIT),
        "this test needs a hard open-file limit above {STARTING_SOFT_LIMIT} (have {hard:?})"
    );
    let dir = scratch_dir(&format!("nvmeof-limits-{}", std::process::id()));
    let port = free_port();
    let config = memory_gateway_toml(port, "nqn.2016-06.io.ceph-nvmeof-rs:limits", "1MiB");
    // The shell lowers the soft limit and then becomes the gateway (exec keeps the PID).
    let launcher = format!("ulimit -Sn {STARTING_SOFT_LIMIT} && exec \"$@\"");
    let mut gateway = GatewayProcess::spawn_via(
        &dir,
        "gateway",
        port,
        &config,
        &["sh", "-c", &launcher, "sh"],
    );
    gateway
        .wait_for_log(
            "NVMe/TCP listener ready",
            Duration::from_secs(20),
            "the gateway never listened",
        )
        .await;
    let (soft, hard_seen) = open_file_limits(gateway.child.id());
    let log = gateway.log_text();
    gateway.terminate();
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(
        soft,
        STARTING_SOFT_LIMIT.to_string(),
        "the soft limit was not raised"
    );
    assert_eq!(soft, hard_seen, "soft limit {soft}, hard limit {hard_seen}");
    assert!(
        log.contains("open-file limit raised to the hard limit"),
        "no log line about the raise: {log}"
    );
}
