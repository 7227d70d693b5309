//! `/healthz` and `/readyz` of `nvmeof-gateway` processes (what Kubernetes' probes ask): a
//! standalone gateway is live and ready once it serves; a gateway of a group is not ready
//! until its first assignment from the control plane is applied, then ready; on SIGTERM it
//! answers "not ready: shutting down" while its planned leave moves its ANA group to a peer,
//! and logs how long the leave took. No Ceph needed: the control plane keeps its state in
//! memory and the gateways serve memory namespaces.
//!
//! The planned move's gap (no gateway reporting the group optimized) is printed, as the
//! gateways' own metrics show it (polled every 5 ms).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gateway_process::GatewayProcess;
use common::{free_port, poll_until};
use control_plane::ana::Timing;
use control_plane::server::{self, Options};
use control_plane::store::{MemoryBackend, Store};
use control_plane::test_support::{http_get, start_replica};

const SUBNQN: &str = "nqn.2016-06.io.test:health";

/// A gateway of the group of the replica at `cp`, owning `ana_group`, serving a memory
/// namespace in ANA group 1 (so either gateway can hold it), with its metrics endpoint.
fn group_gateway_toml(name: &str, cp: &str, ana_group: u16, port: u16, metrics: u16) -> String {
    let cntlid_min = (ana_group - 1) * 1000 + 1;
    format!(
        r#"
[gateway]
name = "{name}"
cntlid_min = {cntlid_min}
cntlid_max = {cntlid_max}
metrics_listen = "127.0.0.1:{metrics}"
worker_threads = 1
[group]
control_plane = ["{cp}"]
ana_group = {ana_group}
beacon_interval_ms = 100
leave_timeout_ms = 5000
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}
[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1MiB"
ana_group = 1
"#,
        cntlid_max = cntlid_min + 999,
    )
}

fn get(metrics: u16, path: &str) -> Option<(u16, String)> {
    http_get(&format!("127.0.0.1:{metrics}"), path)
}

/// Whether the gateway's metrics report ANA group 1 optimized.
fn optimized_here(metrics: u16) -> bool {
    get(metrics, "/metrics").is_some_and(|(_, text)| {
        text.contains(&format!(
            "nvmeof_ana_group_state{{subsystem=\"{SUBNQN}\",ana_group=\"1\",state=\"optimized\"}} 1"
        ))
    })
}

async fn until_answer(metrics: u16, path: &str, want: (u16, &str), within: Duration) {
    poll_until(within, Duration::from_millis(50), async || {
        let got = get(metrics, path);
        if got.as_ref().map(|(c, b)| (*c, b.as_str())) == Some(want) {
            Ok(())
        } else {
            Err(format!("{path}: {got:?}, expected {want:?}"))
        }
    })
    .await
}

#[tokio::test]
async fn a_standalone_gateway_is_live_and_ready_once_it_serves() {
    let dir = std::env::temp_dir().join(format!("gw-health-alone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (_gateway, _port, metrics) =
        GatewayProcess::spawn_memory_with_metrics(&dir, SUBNQN, "").await;
    assert_eq!(get(metrics, "/healthz"), Some((200, "ok\n".into())));
    assert_eq!(get(metrics, "/readyz"), Some((200, "ready\n".into())));
    assert!(get(metrics, "/metrics").is_some_and(|(c, t)| c == 200 && t.contains("nvmeof_")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_gateway_is_ready_after_its_first_assignment_and_not_ready_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("gw-health-group-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    // The control plane's address, not served yet.
    let cp = format!("127.0.0.1:{}", free_port());
    let (port1, metrics1) = (free_port(), free_port());
    let gw1 = GatewayProcess::spawn(
        &dir,
        "gw1",
        port1,
        &group_gateway_toml("gw1", &cp, 1, port1, metrics1),
    );
    gw1.wait_for_metrics(metrics1).await;
    let waiting = (
        503,
        "not ready: waiting for the first assignment from the control plane\n",
    );
    until_answer(metrics1, "/readyz", waiting, Duration::from_secs(5)).await;
    // Still so a while later: nothing but an assignment makes it ready.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        get(metrics1, "/readyz").map(|(c, b)| (c, b)),
        Some((waiting.0, waiting.1.to_string()))
    );
    assert_eq!(get(metrics1, "/healthz"), Some((200, "ok\n".into())));

    // The control plane comes up at that address.
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
        "r1",
        options,
    )
    .await;
    let listener = tokio::net::TcpListener::bind(&cp)
        .await
        .expect("the control plane's port");
    tokio::spawn(server::serve(
        replica,
        listener,
        std::future::pending::<()>(),
    ));
    until_answer(
        metrics1,
        "/readyz",
        (200, "ready\n"),
        Duration::from_secs(15),
    )
    .await;
    gw1.wait_for_log(
        "first assignment applied",
        Duration::from_secs(1),
        "not logged",
    )
    .await;
    gw1.wait_for_log(
        "not ready: waiting for the first assignment",
        Duration::from_secs(1),
        "the reason was not logged",
    )
    .await;

    // A peer that can take ANA group 1 over.
    let (port2, metrics2) = (free_port(), free_port());
    let gw2 = GatewayProcess::spawn(
        &dir,
        "gw2",
        port2,
        &group_gateway_toml("gw2", &cp, 2, port2, metrics2),
    );
    gw2.wait_for_metrics(metrics2).await;
    until_answer(
        metrics2,
        "/readyz",
        (200, "ready\n"),
        Duration::from_secs(15),
    )
    .await;
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || {
            if optimized_here(metrics1) && !optimized_here(metrics2) {
                Ok(())
            } else {
                Err("group 1 never optimized on gw1 alone".to_string())
            }
        },
    )
    .await;

    // SIGTERM: out of the endpoints at once, while the group moves to gw2.
    let mut gw1 = gw1;
    gw1.signal("-TERM");
    let signalled = Instant::now();
    let mut answers = Vec::new();
    let mut last_optimized_on_gw1 = signalled;
    let mut optimized_on_gw2 = None;
    while signalled.elapsed() < Duration::from_secs(10) {
        let answer = get(metrics1, "/readyz");
        let gone = answer.is_none();
        if let Some(a) = answer {
            answers.push(a);
        }
        if optimized_here(metrics1) {
            last_optimized_on_gw1 = Instant::now();
        }
        if optimized_on_gw2.is_none() && optimized_here(metrics2) {
            optimized_on_gw2 = Some(Instant::now());
        }
        if gone && optimized_on_gw2.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        answers.iter().all(|(code, _)| *code == 503),
        "ready after SIGTERM: {answers:?}"
    );
    assert!(
        answers
            .iter()
            .any(|a| *a == (503, "not ready: shutting down\n".to_string())),
        "never answered shutting down: {answers:?}"
    );
    let status = gw1
        .exit_within(Duration::from_secs(10), "gw1 did not exit after SIGTERM")
        .await;
    assert!(status.success(), "{status:?}");
    let log = gw1.log_text();
    let left = log
        .lines()
        .find(|l| l.contains("planned leave: groups moved away"))
        .unwrap_or_else(|| panic!("the leave's duration is not logged:\n{log}"));
    let optimized_on_gw2 = optimized_on_gw2.expect("group 1 never optimized on gw2");
    let gap = optimized_on_gw2.saturating_duration_since(last_optimized_on_gw1);
    println!(
        "planned move (memory state, no Ceph): SIGTERM to optimized on the peer {} ms, no \
         gateway optimized for {} ms (metrics polled every 5 ms); gw1 logged: {left}",
        optimized_on_gw2.duration_since(signalled).as_millis(),
        gap.as_millis()
    );
    drop(gw2);
    let _ = std::fs::remove_dir_all(&dir);
}
