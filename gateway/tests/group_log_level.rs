//! The group's log level reaches a running gateway process live: `nvmeofctl log-level set`
//! (the Admin API's LogLevelSet; ceph-nvmeof's set_gateway_log_level sets the same) is pushed
//! in the gateway's next assignment and its log filter follows it, without a restart; `reset`
//! gives it its own filter (`RUST_LOG=info`) back. No Ceph needed: the control plane keeps its
//! state in memory and the gateway serves a memory namespace.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::gateway_process::GatewayProcess;
use common::{free_port, poll_until};
use control_plane::ana::Timing;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::server::Options;
use control_plane::store::{MemoryBackend, Store};
use control_plane::test_support::{plain_channel, serve_plain, start_replica};

fn gateway_toml(cp: &str, port: u16) -> String {
    format!(
        r#"
[gateway]
name = "gw1"
[group]
control_plane = ["{cp}"]
ana_group = 1
beacon_interval_ms = 200
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}
[[subsystem]]
nqn = "nqn.2016-06.io.test:log-level"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1MiB"
ana_group = 1
"#
    )
}

/// Lines of `level` ("DEBUG", "INFO") in the log.
fn lines_at(log: &str, level: &str) -> usize {
    log.lines()
        .filter(|l| l.split_whitespace().nth(1) == Some(level))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_log_level_reaches_a_running_gateway() {
    let dir = std::env::temp_dir().join(format!("gw-log-level-{}", std::process::id()));
    let options = Options {
        timing: Timing {
            grace_ms: 1500,
            failback_delay_ms: 200,
        },
        lease: Duration::from_secs(3),
        tick: Duration::from_millis(50),
    };
    let replica = start_replica(
        Store::new(Arc::new(MemoryBackend::default())),
        "log-level",
        options,
    )
    .await;
    let cp = serve_plain(replica.clone()).await;
    let port = free_port();
    let gw = GatewayProcess::spawn(&dir, "gw1", port, &gateway_toml(&cp, port));
    gw.wait_for_log(
        "first assignment applied",
        Duration::from_secs(20),
        "the gateway did not join",
    )
    .await;
    // Started with RUST_LOG=info: no debug lines (its beacons log at debug).
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(lines_at(&gw.log_text(), "DEBUG"), 0, "{}", gw.log_text());

    let mut admin = AdminClient::new(plain_channel(&cp).await);
    admin
        .log_level_set(proto::LogLevelRequest {
            level: "debug".into(),
        })
        .await
        .expect("set debug");
    gw.wait_for_log(
        "log level changed level=\"debug\" group_wide=true",
        Duration::from_secs(10),
        "the gateway did not follow the group's level",
    )
    .await;
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || {
            if lines_at(&gw.log_text(), "DEBUG") > 0 {
                Ok(())
            } else {
                Err("no debug line at level debug".to_string())
            }
        },
    )
    .await;

    admin
        .log_level_set(proto::LogLevelRequest {
            level: "error".into(),
        })
        .await
        .expect("set error");
    // Once the assignment is applied nothing below error is written any more.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let settled = gw.log_text().lines().count();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let later: Vec<String> = gw
        .log_text()
        .lines()
        .skip(settled)
        .map(str::to_string)
        .collect();
    assert!(
        later
            .iter()
            .all(|l| !l.contains(" DEBUG ") && !l.contains(" INFO ")),
        "lines below error at level error: {later:?}"
    );

    admin
        .log_level_set(proto::LogLevelRequest {
            level: String::new(),
        })
        .await
        .expect("reset");
    gw.wait_for_log(
        "log level changed level=\"info\" group_wide=false",
        Duration::from_secs(10),
        "the gateway did not go back to its own level",
    )
    .await;
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}
